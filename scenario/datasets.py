"""Image datasets read from local disk.

:func:`load_dataset` looks in every data root for every on-disk layout a
dataset may come in (the original release files, torchvision's layout, an
image-folder tree or tarball) and returns an :class:`ImageDataset`: uint8
images ``(N, H, W, C)`` and int64 labels. The decoded arrays of every layout
are cached as ``.npy`` files under ``$FCL_EMU_CACHE_DIR`` (default
``~/.cache/fcl-emu``), keyed by the source files' paths, sizes and
modification times, and memory-mapped read-only from there: a JPEG tree is
decoded once, and the coordinator, the edge nodes and the GPU workers of one
host share one copy of a dataset's pages instead of each holding its own
(MNIST: 52 MB a process; a CIFAR-10 training set 150 MB). To clear the cache,
delete its directories; never edit its files in place (a process mapping a
truncated file faults).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import math
import os
import pickle
import shutil
import string
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

DATA_ROOT_ENV = "FCL_EMU_DATA_ROOT"
CACHE_DIR_ENV = "FCL_EMU_CACHE_DIR"
_CACHE_FORMAT = 2  # bump when the cached arrays change meaning (2: .npy files, memory-mapped)

_DIGITS = tuple(string.digits)
_UPPER = tuple(string.ascii_uppercase)
_LOWER = tuple(string.ascii_lowercase)
# EMNIST merges the lower-case letters that look like their capitals.
_UNMERGED_LOWER = tuple("abdefghnqrt")
EMNIST_CLASSES: dict[str, tuple[str, ...]] = {
    "byclass": _DIGITS + _UPPER + _LOWER,
    "bymerge": _DIGITS + _UPPER + _UNMERGED_LOWER,
    "balanced": _DIGITS + _UPPER + _UNMERGED_LOWER,
    "letters": _LOWER,
    "digits": _DIGITS,
    "mnist": _DIGITS,
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip

NUM_CLASSES: dict[str, int] = {
    "mnist": 10,
    "fashion-mnist": 10,
    **{f"emnist-{split}": len(names) for split, names in EMNIST_CLASSES.items()},
    "cifar10": 10,
    "cifar100": 100,
    "tiny-imagenet": 200,
}
DATASETS: tuple[str, ...] = tuple(NUM_CLASSES)
"""Names :func:`load_dataset` accepts."""

_TORCHVISION_DIRS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
_MNIST_FILES = (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)  # fmt: skip
_CIFAR10_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))


class DatasetNotFoundError(FileNotFoundError):
    """No data root holds the dataset in any layout we read."""

    def __init__(self, dataset: str, looked_at: Sequence[Path], how_to: str):
        self.dataset = dataset
        self.looked_at = list(looked_at)
        places = "\n".join(f"  - {p}" for p in self.looked_at) or "  (no data roots given)"
        super().__init__(f"dataset {dataset!r} not found. Looked at:\n{places}\n{how_to}")


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt or not in the expected format."""


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset: arrays in memory, or memory-mapped read-only from the cache.

    Images are uint8 ``(N, H, W, C)`` (``C == 1`` for grey), labels int64 with
    the dataset's own class ids. ``mean`` and ``std`` are per-channel
    statistics of the training images on the ``[0, 1]`` scale. Compared by
    identity (the arrays are large).
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.dtype != np.uint8 or x.ndim != 4:
                raise ValueError(f"{split}_x must be uint8 (N, H, W, C), got {x.dtype} {x.shape}")
            if y.dtype != np.int64 or y.shape != (len(x),):
                raise ValueError(f"{split}_y must be int64 of shape ({len(x)},), got {y.dtype} {y.shape}")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(f"{split}_y has labels outside 0..{self.num_classes - 1}")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError(f"train and test images differ: {self.train_x.shape[1:]} vs {self.test_x.shape[1:]}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``, the shape a model sees."""
        _, h, w, c = self.train_x.shape
        return (c, h, w)


class _Arrays(NamedTuple):
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    class_names: tuple[str, ...]


class _Layout(NamedTuple):
    """One place a dataset may be: the path we report, and a loader if it is there."""

    path: Path
    load: Callable[[], _Arrays] | None


# ---------------------------------------------------------------- public API


def roots_from_env() -> list[Path]:
    """Data roots named by ``$FCL_EMU_DATA_ROOT`` (``os.pathsep``-separated)."""
    value = os.environ.get(DATA_ROOT_ENV, "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p]


def default_data_roots() -> list[Path]:
    """``$FCL_EMU_DATA_ROOT`` (os.pathsep-separated) if set, else ``./data``."""
    return roots_from_env() or [Path("data")]


def cache_dir() -> Path:
    """Where decoded arrays are cached: ``$FCL_EMU_CACHE_DIR`` or ``~/.cache/fcl-emu``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/fcl-emu").expanduser()


def load_dataset(name: str, roots: Sequence[Path], download: bool = False) -> ImageDataset:
    """Load dataset ``name`` from the first root holding it in a known layout.

    With ``download=True`` a dataset found nowhere is downloaded with
    torchvision into ``roots[0]`` first. Raises :class:`DatasetNotFoundError`
    naming every path looked at, and :class:`DatasetFormatError` for a corrupt
    file.
    """
    if name not in NUM_CLASSES:
        raise ValueError(f"unknown dataset {name!r}; supported: {', '.join(DATASETS)}")
    roots = [Path(r).expanduser() for r in roots]
    looked_at = []
    for root in roots:
        for layout in _layouts(name, root):
            looked_at.append(layout.path)
            if layout.load is not None:
                return _to_dataset(name, layout.load())
    if not download:
        raise DatasetNotFoundError(name, looked_at, _how_to_get(name, roots))
    if not roots:
        raise DatasetNotFoundError(name, [], "Downloading needs a data root to download into.")
    _download(name, roots[0])
    return load_dataset(name, roots[:1])


# ---------------------------------------------------------------- layouts


def _layouts(name: str, root: Path) -> list[_Layout]:
    if name in _TORCHVISION_DIRS:
        dirs = [root / name, root / _TORCHVISION_DIRS[name] / "raw"]
        classes = _DIGITS if name == "mnist" else FASHION_MNIST_CLASSES
        return [_idx_layout(name, d, _MNIST_FILES, classes) for d in dirs]
    if name.startswith("emnist-"):
        split = name.removeprefix("emnist-")
        files = tuple(
            f"emnist-{split}-{part}-{kind}"
            for part in ("train", "test")
            for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
        )
        dirs = [root / "emnist", root / "EMNIST" / "raw"]
        return [_idx_layout(name, d, files, EMNIST_CLASSES[split], emnist_split=split) for d in dirs]
    if name == "cifar10":
        return [
            _image_tar_layout(name, root / "cifar10" / "cifar10-jpeg.tar.gz"),
            _image_folder_layout(name, root / "cifar10"),
            _cifar_pickle_layout(
                name, root / "cifar-10-batches-py", _CIFAR10_BATCHES, "test_batch", "batches.meta", b"labels",
                b"label_names",
            ),
        ]
    if name == "cifar100":
        return [
            _cifar_pickle_layout(
                name, root / "cifar-100-python", ("train",), "test", "meta", b"fine_labels", b"fine_label_names"
            )
        ]
    if name == "tiny-imagenet":
        return [_tiny_imagenet_layout(root / "tiny-imagenet-200")]
    raise AssertionError(name)


def _find_file(directory: Path, base: str) -> Path | None:
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _idx_layout(
    name: str, directory: Path, files: Sequence[str], classes: tuple[str, ...], emnist_split: str | None = None
) -> _Layout:
    paths = [_find_file(directory, f) for f in files]
    if any(p is None for p in paths):
        return _Layout(directory, None)
    return _Layout(directory,
                   lambda: _cached(name, "idx", paths, lambda: _read_idx_set(paths, classes, emnist_split)))


def _image_tar_layout(name: str, tarball: Path) -> _Layout:
    if not tarball.is_file():
        return _Layout(tarball, None)
    return _Layout(tarball, lambda: _cached(name, "jpeg-tar", [tarball], lambda: _read_image_tar(tarball)))


def _image_folder_layout(name: str, directory: Path) -> _Layout:
    if not ((directory / "train").is_dir() and (directory / "test").is_dir()):
        return _Layout(directory / "train", None)

    def load() -> _Arrays:
        files = sorted(p for split in ("train", "test") for p in (directory / split).glob("*/*") if p.is_file())
        return _cached(name, "image-folder", files, lambda: _read_image_folder(directory))

    return _Layout(directory / "train", load)


def _cifar_pickle_layout(
    name: str, directory: Path, train: Sequence[str], test: str, meta: str, label_key: bytes, names_key: bytes
) -> _Layout:
    files = [directory / f for f in (*train, test, meta)]
    if not all(f.is_file() for f in files):
        return _Layout(directory, None)

    def decode() -> _Arrays:
        train_x, train_y = _read_cifar_batches([directory / f for f in train], label_key)
        test_x, test_y = _read_cifar_batches([directory / test], label_key)
        meta_dict = _unpickle(directory / meta)
        if names_key not in meta_dict:
            raise DatasetFormatError(f"{directory / meta}: missing key {names_key!r}")
        names = tuple(n.decode() for n in meta_dict[names_key])
        return _Arrays(train_x, train_y, test_x, test_y, names)

    return _Layout(directory, lambda: _cached(name, "pickle", files, decode))


def _tiny_imagenet_layout(directory: Path) -> _Layout:
    required = (directory / "wnids.txt", directory / "val" / "val_annotations.txt")
    if not all(p.is_file() for p in required) or not (directory / "train").is_dir():
        return _Layout(directory, None)

    def load() -> _Arrays:
        images = [*(directory / "train").glob("*/images/*"), *(directory / "val" / "images").glob("*")]
        files = sorted([*images, *required])
        return _cached("tiny-imagenet", "folder", files, lambda: _read_tiny_imagenet(directory))

    return _Layout(directory, load)


# ---------------------------------------------------------------- IDX (MNIST family)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file of unsigned bytes (optionally gzip-compressed).

    Checks the magic number and that the data length matches the header's
    dimensions before allocating.
    """
    try:
        compressed = _is_gzip(path)
        stored = _gzip_size(path) if compressed else path.stat().st_size
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[:2] != b"\0\0":
                raise DatasetFormatError(f"{path}: not an IDX file (bad magic number {magic.hex()})")
            if magic[2] != 0x08:
                raise DatasetFormatError(f"{path}: IDX element type 0x{magic[2]:02x} is not unsigned byte (0x08)")
            ndim = magic[3]
            raw_dims = f.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                raise DatasetFormatError(f"{path}: truncated IDX header")
            dims = tuple(int(d) for d in np.frombuffer(raw_dims, dtype=">u4"))
            expected = 4 + 4 * ndim + math.prod(dims)
            if expected % 2**32 != stored % 2**32:
                raise DatasetFormatError(
                    f"{path}: truncated or corrupt: the header promises {expected} bytes (dims {dims}), "
                    f"the file holds {stored}"
                )
            out = np.empty(dims, dtype=np.uint8)
            _read_exactly(f, memoryview(out).cast("B"), path)
            if f.read(1):
                raise DatasetFormatError(f"{path}: data after the last IDX element")
    except (EOFError, OSError, zlib.error) as e:
        raise DatasetFormatError(f"{path}: corrupt or truncated file ({e})") from e
    return out


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _gzip_size(path: Path) -> int:
    """Uncompressed size modulo 2**32, from the gzip trailer."""
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


def _read_exactly(f: io.BufferedIOBase, buffer: memoryview, path: Path) -> None:
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done:])
        if not n:
            raise DatasetFormatError(f"{path}: truncated IDX data ({done} of {len(buffer)} bytes)")
        done += n


def _read_idx_set(paths: Sequence[Path], classes: tuple[str, ...], emnist_split: str | None) -> _Arrays:
    arrays = []
    for images_path, labels_path in (paths[:2], paths[2:]):
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise DatasetFormatError(
                f"{images_path}, {labels_path}: expected 3-d images and 1-d labels, "
                f"got shapes {images.shape} and {labels.shape}"
            )
        if len(images) != len(labels):
            raise DatasetFormatError(f"{images_path}: {len(images)} images but {len(labels)} labels in {labels_path}")
        labels = labels.astype(np.int64)
        if emnist_split is not None:
            images = np.ascontiguousarray(images.transpose(0, 2, 1))  # EMNIST stores images transposed
            if emnist_split == "letters":
                labels -= 1  # letters are labelled 1..26
        arrays += [images[..., None], labels]
    return _Arrays(*arrays, classes)


# ---------------------------------------------------------------- CIFAR pickles


def _unpickle(path: Path) -> dict:
    # The CIFAR releases are Python pickles. Unpickling can run code, so it is
    # done only on dataset files the user placed on local disk, never on bytes
    # received from the network (which the project's wire rules forbid).
    try:
        with open(path, "rb") as f:
            data = pickle.load(f, encoding="bytes")
    except Exception as e:  # any failure to parse the file means it is not a CIFAR pickle
        raise DatasetFormatError(f"{path}: not a readable CIFAR pickle ({e!r})") from e
    if not isinstance(data, dict):
        raise DatasetFormatError(f"{path}: expected a dict, got {type(data).__name__}")
    return data


def _read_cifar_batches(paths: Sequence[Path], label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for path in paths:
        batch = _unpickle(path)
        try:
            data = np.asarray(batch[b"data"], dtype=np.uint8)
            labels = np.asarray(batch[label_key], dtype=np.int64)
        except KeyError as e:
            raise DatasetFormatError(f"{path}: missing key {e}") from e
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
            raise DatasetFormatError(f"{path}: expected (N, 3072) data and N labels, got {data.shape}, {labels.shape}")
        xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(labels)
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


# ---------------------------------------------------------------- JPEG trees


def _decode_rgb(data: bytes | Path, where: str) -> np.ndarray:
    try:
        with Image.open(data if isinstance(data, Path) else io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except (OSError, ValueError) as e:
        raise DatasetFormatError(f"{where}: cannot decode image ({e})") from e


def _stack(images: list[np.ndarray], where: str) -> np.ndarray:
    if not images:
        raise DatasetFormatError(f"{where}: no images")
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        raise DatasetFormatError(f"{where}: images differ in size: {sorted(shapes)[:4]}")
    return np.stack(images)


def _from_items(items: dict[str, list[tuple[str, str, np.ndarray]]], where: str) -> _Arrays:
    """Arrays from ``{split: [(class, file name, image)]}``; class id = rank of the sorted name."""
    names = tuple(sorted({cls for cls, _, _ in items["train"]}))
    unknown = {cls for cls, _, _ in items["test"]} - set(names)
    if unknown:
        raise DatasetFormatError(f"{where}: test classes {sorted(unknown)} have no training images")
    index = {n: i for i, n in enumerate(names)}
    out = []
    for split in ("train", "test"):
        ordered = sorted(items[split], key=lambda it: (it[0], it[1]))
        out.append(_stack([im for _, _, im in ordered], f"{where} ({split})"))
        out.append(np.array([index[cls] for cls, _, _ in ordered], dtype=np.int64))
    return _Arrays(*out, names)


def _read_image_tar(path: Path) -> _Arrays:
    """Decode ``train/<class>/<file>`` and ``test/<class>/<file>`` straight from a tarball."""
    items: dict[str, list] = {"train": [], "test": []}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if member.isfile() and len(parts) >= 3 and parts[-3] in items:
                    data = tar.extractfile(member).read()
                    items[parts[-3]].append((parts[-2], parts[-1], _decode_rgb(data, f"{path}:{member.name}")))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DatasetFormatError(f"{path}: corrupt tarball ({e})") from e
    return _from_items(items, str(path))


def _read_image_folder(directory: Path) -> _Arrays:
    items = {
        split: [(p.parent.name, p.name, _decode_rgb(p, str(p))) for p in (directory / split).glob("*/*") if p.is_file()]
        for split in ("train", "test")
    }
    return _from_items(items, str(directory))


def _read_tiny_imagenet(directory: Path) -> _Arrays:
    wnids = [w.strip() for w in (directory / "wnids.txt").read_text().split() if w.strip()]
    words = {}
    if (directory / "words.txt").is_file():
        for line in (directory / "words.txt").read_text().splitlines():
            wnid, _, text = line.partition("\t")
            words[wnid] = text.split(",")[0].strip()
    index = {w: i for i, w in enumerate(wnids)}

    def load(pairs: Iterable[tuple[Path, str]], split: str) -> tuple[np.ndarray, np.ndarray]:
        pairs = sorted(pairs, key=lambda p: (index[p[1]], p[0].name))
        images = _stack([_decode_rgb(p, str(p)) for p, _ in pairs], f"{directory} ({split})")
        return images, np.array([index[w] for _, w in pairs], dtype=np.int64)

    train = [(p, w) for w in wnids for p in (directory / "train" / w / "images").glob("*") if p.is_file()]
    val = []
    for line in (directory / "val" / "val_annotations.txt").read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DatasetFormatError(f"{directory / 'val' / 'val_annotations.txt'}: bad line {line!r}")
        val.append((directory / "val" / "images" / fields[0], fields[1]))
    train_x, train_y = load(train, "train")
    test_x, test_y = load(val, "val")
    return _Arrays(train_x, train_y, test_x, test_y, tuple(words.get(w, w) for w in wnids))


# ---------------------------------------------------------------- cache


def _cached(name: str, layout: str, sources: Sequence[Path], build: Callable[[], _Arrays]) -> _Arrays:
    """``build()``, memoised on disk under a key of the sources' paths, sizes and mtimes, and memory-mapped
    read-only from there: the processes of one host that load the dataset share one copy of its pages (the
    page cache) instead of each holding its own. Where the cache cannot be written the arrays stay in memory."""
    stats = [(str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns) for p in sources]
    key = hashlib.sha256(json.dumps([_CACHE_FORMAT, name, layout, stats]).encode()).hexdigest()[:24]
    path = cache_dir() / f"{name}-{layout}-{key}"
    if path.is_dir():
        try:
            return _read_cache(path)
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable dataset cache %s (%s)", path, e)
    arrays = build()
    try:
        _write_cache(path, arrays)
        return _read_cache(path)
    except (OSError, ValueError) as e:
        log.warning("could not write dataset cache %s (%s)", path, e)
        return arrays


def _read_cache(path: Path) -> _Arrays:
    names = json.loads((path / "class_names.json").read_text())
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("class_names.json is not a list of names")
    arrays = [np.load(path / f"{field}.npy", mmap_mode="r", allow_pickle=False) for field in _Arrays._fields[:4]]
    return _Arrays(*arrays, tuple(names))


def _write_cache(path: Path, arrays: _Arrays) -> None:
    """One ``.npy`` per array and the class names, written beside ``path`` and renamed into place: a reader
    sees no cache or a whole one. Files are never rewritten in place (a process mapping them would fault);
    an unreadable cache is unlinked and replaced, a whole one written meanwhile by another process kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        for field in _Arrays._fields[:4]:
            np.save(tmp / f"{field}.npy", getattr(arrays, field), allow_pickle=False)
        (tmp / "class_names.json").write_text(json.dumps(list(arrays.class_names)))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, path)
        except OSError:  # the directory is there
            try:
                _read_cache(path)
            except (OSError, ValueError):
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- assembly and download


def _channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std on the [0, 1] scale, via byte histograms."""
    values = np.arange(256) / 255.0
    means, stds = [], []
    for c in range(images.shape[-1]):
        hist = np.zeros(256, dtype=np.int64)
        # chunks keep bincount's int64 copy small: freed 25 MB blocks (4,096 MNIST images) stayed in the
        # process's heap, larger than the memory-mapped training images themselves
        for start in range(0, len(images), 256):
            hist += np.bincount(images[start : start + 256, ..., c].ravel(), minlength=256)
        n = hist.sum()
        mean = float(hist @ values / n)
        means.append(mean)
        stds.append(float(math.sqrt(max(hist @ values**2 / n - mean**2, 0.0))))
    return tuple(means), tuple(stds)


def _to_dataset(name: str, a: _Arrays) -> ImageDataset:
    if len(a.class_names) != NUM_CLASSES[name]:
        raise DatasetFormatError(f"{name}: found {len(a.class_names)} classes, expected {NUM_CLASSES[name]}")
    mean, std = _channel_stats(a.train_x)
    return ImageDataset(name, a.train_x, a.train_y, a.test_x, a.test_y, NUM_CLASSES[name], a.class_names, mean, std)


def _how_to_get(name: str, roots: Sequence[Path]) -> str:
    where = roots[0] if roots else Path("<data root>")
    if name == "tiny-imagenet":
        return (
            f"torchvision cannot download Tiny-ImageNet: fetch http://cs231n.stanford.edu/tiny-imagenet-200.zip "
            f"and unzip it into a data root (giving {where / 'tiny-imagenet-200'}/wnids.txt, train/, val/)."
        )
    return (
        f"Get it with --download (torchvision fetches it into {where}; needs network access and "
        f"`pip install torchvision`), or put the files there yourself in torchvision's layout. "
        f"Data roots come from the command line or ${DATA_ROOT_ENV} ({os.pathsep}-separated)."
    )


def _download(name: str, root: Path) -> None:
    if name == "tiny-imagenet":
        raise DatasetNotFoundError(name, [root / "tiny-imagenet-200"], _how_to_get(name, [root]))
    try:
        import torchvision.datasets as tvd
    except ImportError as e:
        raise ImportError(
            f"downloading {name} needs torchvision: pip install torchvision (or pip install 'fcl-emu[download]')"
        ) from e
    root.mkdir(parents=True, exist_ok=True)
    try:
        if name.startswith("emnist-"):
            tvd.EMNIST(str(root), split=name.removeprefix("emnist-"), download=True)
        else:
            loader = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}
            getattr(tvd, loader[name])(str(root), download=True)
    except (OSError, RuntimeError) as e:
        raise RuntimeError(f"downloading {name} into {root} with torchvision failed: {e}") from e

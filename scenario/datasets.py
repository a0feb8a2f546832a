"""The image datasets a scenario may name, read from local disk.

:func:`load_dataset` looks in every data root for every on-disk layout a
dataset may come in (the original release files, torchvision's layout, an
image-folder tree or tarball; decoded by :mod:`fcl_emu.scenario.dataset_formats`) and
returns an :class:`ImageDataset`: uint8 images ``(N, H, W, C)`` and int64
labels, memory-mapped read-only from the cache of decoded arrays
(:mod:`fcl_emu.scenario.dataset_cache`).
"""

from __future__ import annotations

import math
import os
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fcl_emu.scenario.dataset_cache import cached
from fcl_emu.scenario.dataset_formats import (CLASS_FILE, DatasetFormatError, DecodedArrays, read_cifar_pickles,
                                      read_idx_set, read_image_folder, read_image_tar, read_tiny_imagenet)

DATA_ROOT_ENV = "FCL_EMU_DATA_ROOT"

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
    "tiny-imagenet-32": 200,
    "mnist-fashion": 20,
}
#: Data sets made of two others side by side: the second's classes after the first's (AF-FCL's task pools mix
#: data sets; MNIST + Fashion-MNIST gives 20 classes of 28x28 grey images).
UNIONS: dict[str, tuple[str, str]] = {"mnist-fashion": ("mnist", "fashion-mnist")}
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
        places = ", ".join(str(p) for p in self.looked_at) or "(no data roots given)"
        super().__init__(f"dataset {dataset!r} not found (looked at {places}). {how_to}")  # one line


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


class _Layout(NamedTuple):
    """One place a dataset may be: the path we report, and a loader if it is there."""

    path: Path
    load: Callable[[], DecodedArrays] | None


# ---------------------------------------------------------------- public API


def roots_from_env() -> list[Path]:
    """Data roots named by ``$FCL_EMU_DATA_ROOT`` (``os.pathsep``-separated)."""
    value = os.environ.get(DATA_ROOT_ENV, "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p]


def default_data_roots() -> list[Path]:
    """``$FCL_EMU_DATA_ROOT`` (os.pathsep-separated) if set, else ``./data``."""
    return roots_from_env() or [Path("data")]


def load_dataset(name: str, roots: Sequence[Path], download: bool = False) -> ImageDataset:
    """Load dataset ``name`` from the first root holding it in a known layout.

    With ``download=True`` a dataset found nowhere is downloaded with
    torchvision into ``roots[0]`` first. Raises :class:`DatasetNotFoundError`
    naming every path looked at, and :class:`DatasetFormatError` for a corrupt
    file.
    """
    if name in UNIONS:
        return _union(name, [load_dataset(part, roots, download) for part in UNIONS[name]])
    try:
        layout = _find_layout(name, roots)
    except DatasetNotFoundError:
        if not download:
            raise
        if not roots:
            raise DatasetNotFoundError(name, [], "Downloading needs a data root to download into.") from None
        root = Path(roots[0]).expanduser()
        _download(name, root)
        layout = _find_layout(name, [root])
    return _to_dataset(name, layout.load())


def class_subset(dataset: ImageDataset, classes: Sequence[int]) -> ImageDataset:
    """``dataset`` restricted to ``classes`` (its own class ids, distinct), relabelled ``0..len(classes)-1`` in
    ascending order of id, with their names; the normalisation statistics stay the whole dataset's."""
    kept = np.unique(np.asarray(classes, dtype=np.int64))
    if len(kept) != len(classes) or kept[0] < 0 or kept[-1] >= dataset.num_classes:
        raise ValueError(f"a class subset needs distinct ids in 0..{dataset.num_classes - 1}, got {list(classes)}")
    relabel = np.full(dataset.num_classes, -1, dtype=np.int64)
    relabel[kept] = np.arange(len(kept))
    train, test = np.isin(dataset.train_y, kept), np.isin(dataset.test_y, kept)
    return ImageDataset(dataset.name, dataset.train_x[train], relabel[dataset.train_y[train]], dataset.test_x[test],
                        relabel[dataset.test_y[test]], len(kept), tuple(dataset.class_names[c] for c in kept),
                        dataset.mean, dataset.std)


def find_dataset(name: str, roots: Sequence[Path]) -> Path:
    """Where :func:`load_dataset` would load dataset ``name`` from, without reading it (a check before a run
    starts; a union: its first part, every part checked). Raises :class:`DatasetNotFoundError` naming every path
    looked at."""
    if name in UNIONS:
        return [find_dataset(part, roots) for part in UNIONS[name]][0]
    return _find_layout(name, roots).path


def _find_layout(name: str, roots: Sequence[Path]) -> _Layout:
    if name not in NUM_CLASSES:
        raise ValueError(f"unknown dataset {name!r}; supported: {', '.join(DATASETS)}")
    roots = [Path(r).expanduser() for r in roots]
    looked_at = []
    for root in roots:
        for layout in _layouts(name, root):
            looked_at.append(layout.path)
            if layout.load is not None:
                return layout
    raise DatasetNotFoundError(name, looked_at, _how_to_get(name, roots))


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
    if name == "tiny-imagenet-32":
        directory = root / "tiny-imagenet-32"
        return [_image_tar_layout(name, directory / "tiny-imagenet-32-jpeg.tar.gz", named=True),
                _image_folder_layout(name, directory, named=True)]
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
                   lambda: cached(name, "idx", paths, lambda: read_idx_set(paths, classes, emnist_split)))


def _image_tar_layout(name: str, tarball: Path, named: bool = False) -> _Layout:
    """An image-folder tree in a tarball; ``named``: class names from its ``classes.txt``, else its folders'."""
    if not tarball.is_file():
        return _Layout(tarball, None)
    return _Layout(tarball, lambda: cached(name, "jpeg-tar", [tarball], lambda: read_image_tar(tarball, named)))


def _image_folder_layout(name: str, directory: Path, named: bool = False) -> _Layout:
    """The same tree extracted into ``directory``."""
    if not ((directory / "train").is_dir() and (directory / "test").is_dir()):
        return _Layout(directory / "train", None)
    if named and not (directory / CLASS_FILE).is_file():
        return _Layout(directory / CLASS_FILE, None)

    def load() -> DecodedArrays:
        files = sorted(p for split in ("train", "test") for p in (directory / split).glob("*/*") if p.is_file())
        files += [directory / CLASS_FILE] if named else []
        return cached(name, "image-folder", files, lambda: read_image_folder(directory, named))

    return _Layout(directory / "train", load)


def _cifar_pickle_layout(
    name: str, directory: Path, train: Sequence[str], test: str, meta: str, label_key: bytes, names_key: bytes
) -> _Layout:
    files = [directory / f for f in (*train, test, meta)]
    if not all(f.is_file() for f in files):
        return _Layout(directory, None)

    return _Layout(directory, lambda: cached(
        name, "pickle", files, lambda: read_cifar_pickles(directory, train, test, meta, label_key, names_key)))


def _tiny_imagenet_layout(directory: Path) -> _Layout:
    required = (directory / "wnids.txt", directory / "val" / "val_annotations.txt")
    if not all(p.is_file() for p in required) or not (directory / "train").is_dir():
        return _Layout(directory, None)

    def load() -> DecodedArrays:
        images = [*(directory / "train").glob("*/images/*"), *(directory / "val" / "images").glob("*")]
        files = sorted([*images, *required])
        return cached("tiny-imagenet", "folder", files, lambda: read_tiny_imagenet(directory))

    return _Layout(directory, load)


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


def _union(name: str, parts: list[ImageDataset]) -> ImageDataset:
    """``parts`` side by side as data set ``name``: each part's labels after the earlier parts' classes."""
    if len({p.train_x.shape[1:] for p in parts}) != 1:
        raise DatasetFormatError(f"{name}: its parts' images differ in shape: "
                                 f"{', '.join(f'{p.name} {p.train_x.shape[1:]}' for p in parts)}")
    offsets = np.cumsum([0] + [p.num_classes for p in parts[:-1]])
    arrays = DecodedArrays(np.concatenate([p.train_x for p in parts]),
                           np.concatenate([p.train_y + o for p, o in zip(parts, offsets)]),
                           np.concatenate([p.test_x for p in parts]),
                           np.concatenate([p.test_y + o for p, o in zip(parts, offsets)]),
                           tuple(n for p in parts for n in p.class_names))
    return _to_dataset(name, arrays)


def _to_dataset(name: str, a: DecodedArrays) -> ImageDataset:
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
    if name == "tiny-imagenet-32":
        return (
            f"Tiny-ImageNet-32 (Tiny-ImageNet resized to 32x32) has no download, from torchvision or elsewhere. "
            f"Put its tarball at {where / 'tiny-imagenet-32' / 'tiny-imagenet-32-jpeg.tar.gz'} (or extract it into "
            f"{where / 'tiny-imagenet-32'}/): train/<wnid>/*.jpg, test/<wnid>/*.jpg and classes.txt (<wnid>, tab, "
            f"its words). To build it, fetch http://cs231n.stanford.edu/tiny-imagenet-200.zip, resize every image "
            f"to 32x32, write the training images by class and the validation images (val_annotations.txt) as "
            f"test/, and classes.txt from wnids.txt and words.txt; or run --dataset tiny-imagenet on that zip's "
            f"64x64 images directly."
        )
    return (
        f"Get it with --download (torchvision fetches it into {where}; needs network access and "
        f"`pip install torchvision`), or put the files there yourself in torchvision's layout. "
        f"Data roots come from the command line or ${DATA_ROOT_ENV} ({os.pathsep}-separated)."
    )


def _download(name: str, root: Path) -> None:
    if name in ("tiny-imagenet", "tiny-imagenet-32"):
        raise DatasetNotFoundError(name, [layout.path for layout in _layouts(name, root)], _how_to_get(name, [root]))
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

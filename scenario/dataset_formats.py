"""Decoding the files image datasets come in: IDX (the MNIST family), the CIFAR pickles, JPEG trees (a folder
or a tarball, optionally with a ``classes.txt`` naming the classes) and Tiny-ImageNet's folder, each into
:class:`DecodedArrays` with every shape and label checked.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import pickle
import tarfile
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np
from PIL import Image


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt or not in the expected format."""


class DecodedArrays(NamedTuple):
    """A dataset as decoded: uint8 images ``(N, H, W, C)``, int64 labels, the class names by label."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    class_names: tuple[str, ...]


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


def read_idx_set(paths: Sequence[Path], classes: tuple[str, ...], emnist_split: str | None) -> DecodedArrays:
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
    return DecodedArrays(*arrays, classes)


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


def read_cifar_pickles(
    directory: Path, train: Sequence[str], test: str, meta: str, label_key: bytes, names_key: bytes
) -> DecodedArrays:
    """A CIFAR release: the ``train`` batches, the ``test`` batch and the class names under ``names_key`` in
    ``meta``."""
    train_x, train_y = _read_cifar_batches([directory / f for f in train], label_key)
    test_x, test_y = _read_cifar_batches([directory / test], label_key)
    meta_dict = _unpickle(directory / meta)
    if names_key not in meta_dict:
        raise DatasetFormatError(f"{directory / meta}: missing key {names_key!r}")
    names = tuple(n.decode() for n in meta_dict[names_key])
    return DecodedArrays(train_x, train_y, test_x, test_y, names)


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


CLASS_FILE = "classes.txt"
"""Beside an image-folder tree's ``train/`` and ``test/`` (Tiny-ImageNet-32): one line per class, its folder name,
a tab, its words (comma-separated synonyms, the first of which names the class)."""


def parse_class_file(text: str, where: str) -> dict[str, str]:
    """``{folder name: class name}`` from a :data:`CLASS_FILE`'s text; the class name is the first of its words."""
    words = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        folder, tab, synonyms = line.partition("\t")
        name = synonyms.split(",")[0].strip()
        if not tab or not folder.strip() or not name:
            raise DatasetFormatError(f"{where}: line {number} is not '<folder>\\t<words>': {line!r}")
        if folder.strip() in words:
            raise DatasetFormatError(f"{where}: class {folder.strip()!r} named twice")
        words[folder.strip()] = name
    return words


def _from_items(items: dict[str, list[tuple[str, str, np.ndarray]]], where: str,
                words: dict[str, str] | None = None) -> DecodedArrays:
    """Arrays from ``{split: [(class, file name, image)]}``; class id = rank of the sorted folder name. With
    ``words`` (``{folder: class name}``, one entry per folder) the classes are named by it, else by folder."""
    folders = tuple(sorted({cls for cls, _, _ in items["train"]}))
    unknown = {cls for cls, _, _ in items["test"]} - set(folders)
    if unknown:
        raise DatasetFormatError(f"{where}: test classes {sorted(unknown)} have no training images")
    if words is not None and set(words) != set(folders):
        raise DatasetFormatError(
            f"{where}: {CLASS_FILE} names {len(words)} classes, the images {len(folders)}; without images: "
            f"{sorted(set(words) - set(folders))[:4]}, unnamed: {sorted(set(folders) - set(words))[:4]}")
    index = {n: i for i, n in enumerate(folders)}
    out = []
    for split in ("train", "test"):
        ordered = sorted(items[split], key=lambda it: (it[0], it[1]))
        out.append(_stack([im for _, _, im in ordered], f"{where} ({split})"))
        out.append(np.array([index[cls] for cls, _, _ in ordered], dtype=np.int64))
    return DecodedArrays(*out, folders if words is None else tuple(words[f] for f in folders))


def read_image_tar(path: Path, named: bool = False) -> DecodedArrays:
    """Decode ``train/<class>/<file>`` and ``test/<class>/<file>`` straight from a tarball; ``named``: the class
    names from the tarball's top-level :data:`CLASS_FILE`."""
    items: dict[str, list] = {"train": [], "test": []}
    class_text = None
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if member.isfile() and len(parts) >= 3 and parts[-3] in items:
                    data = tar.extractfile(member).read()
                    items[parts[-3]].append((parts[-2], parts[-1], _decode_rgb(data, f"{path}:{member.name}")))
                elif named and member.isfile() and parts == (CLASS_FILE,):
                    class_text = tar.extractfile(member).read().decode()
    except (tarfile.TarError, EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{path}: corrupt tarball ({e})") from e
    if named and class_text is None:
        raise DatasetFormatError(f"{path}: no {CLASS_FILE} at the top of the tarball")
    words = parse_class_file(class_text, f"{path}:{CLASS_FILE}") if named else None
    return _from_items(items, str(path), words)


def read_image_folder(directory: Path, named: bool = False) -> DecodedArrays:
    """The same tree extracted into ``directory``; ``named``: the class names from ``directory/classes.txt``."""
    items = {
        split: [(p.parent.name, p.name, _decode_rgb(p, str(p))) for p in (directory / split).glob("*/*") if p.is_file()]
        for split in ("train", "test")
    }
    words = parse_class_file((directory / CLASS_FILE).read_text(), str(directory / CLASS_FILE)) if named else None
    return _from_items(items, str(directory), words)


def read_tiny_imagenet(directory: Path) -> DecodedArrays:
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
    return DecodedArrays(train_x, train_y, test_x, test_y, tuple(words.get(w, w) for w in wnids))

"""Dataset loaders: every on-disk layout on tiny fixtures, bad inputs, the cache, and the real shared data."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import random
import struct
import sys
import tarfile
import time
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fcl_emu.scenario import dataset_formats, datasets
from fcl_emu.scenario.dataset_cache import CACHE_DIR_ENV
from fcl_emu.scenario.dataset_formats import DatasetFormatError, read_idx
from fcl_emu.scenario.datasets import DATASETS, EMNIST_CLASSES, DatasetNotFoundError, ImageDataset, load_dataset

CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Every test caches into its own directory."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))


# ---------------------------------------------------------------- fixture writers


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    data = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def mnist_arrays(seed: int = 0, h: int = 5, w: int = 4, n_train: int = 30, n_test: int = 10, classes: int = 10):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, h, w), dtype=np.uint8),
        (np.arange(n_train) % classes).astype(np.uint8),
        rng.integers(0, 256, (n_test, h, w), dtype=np.uint8),
        (np.arange(n_test) % classes).astype(np.uint8),
    )


def write_mnist(directory: Path, gz: bool, seed: int = 0, names=datasets._MNIST_FILES):
    arrays = mnist_arrays(seed)
    for name, array in zip(names, arrays):
        write_idx(directory / name, array, gz)
    return arrays


def jpeg_bytes(rng: np.random.Generator, size=(32, 32), mode="RGB") -> bytes:
    shape = (*size, 3) if mode == "RGB" else size
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(buf, format="JPEG")
    return buf.getvalue()


def cifar10_jpeg_entries(seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {
        f"{split}/{cls}/{i:04d}.jpg": jpeg_bytes(rng)
        for split, per_class in (("train", 2), ("test", 1))
        for cls in CIFAR10_NAMES
        for i in range(per_class)
    }


def write_tar(path: Path, entries: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(entries)
    random.Random(0).shuffle(names)  # the loader must not depend on member order
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(entries[name])
            tar.addfile(info, io.BytesIO(entries[name]))
    return path


def write_tree(root: Path, entries: dict[str, bytes]) -> None:
    for name, data in entries.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def write_pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))


# ---------------------------------------------------------------- MNIST family


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("name, subdir", [("mnist", "mnist"), ("fashion-mnist", "fashion-mnist")])
def test_idx_flat_layout(tmp_path, name, subdir, gz):
    train_x, train_y, test_x, test_y = write_mnist(tmp_path / subdir, gz)
    ds = load_dataset(name, [tmp_path])
    assert ds.name == name and ds.num_classes == 10 and len(ds.class_names) == 10
    np.testing.assert_array_equal(ds.train_x[..., 0], train_x)
    np.testing.assert_array_equal(ds.test_x[..., 0], test_x)
    assert ds.train_y.dtype == np.int64 and ds.train_y.tolist() == train_y.tolist()
    assert ds.test_y.tolist() == test_y.tolist()
    assert ds.input_shape == (1, 5, 4)
    assert ds.mean[0] == pytest.approx(train_x.mean() / 255)
    assert ds.std[0] == pytest.approx((train_x / 255).std())


@pytest.mark.parametrize("name, subdir", [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_idx_torchvision_layout(tmp_path, name, subdir):
    train_x, *_ = write_mnist(tmp_path / subdir / "raw", gz=False)
    ds = load_dataset(name, [tmp_path])
    np.testing.assert_array_equal(ds.train_x[..., 0], train_x)


def test_mnist_fashion_is_both_side_by_side_with_fashions_labels_after_the_digits(tmp_path):
    mx, my, mtx, mty = write_mnist(tmp_path / "mnist", gz=False, seed=1)
    fx, fy, ftx, fty = write_mnist(tmp_path / "fashion-mnist", gz=False, seed=2)
    ds = load_dataset("mnist-fashion", [tmp_path])
    assert ds.name == "mnist-fashion" and ds.num_classes == 20
    assert ds.class_names[:10] == datasets._DIGITS and ds.class_names[10:] == datasets.FASHION_MNIST_CLASSES
    np.testing.assert_array_equal(ds.train_x[..., 0], np.concatenate([mx, fx]))
    assert ds.train_y.tolist() == my.tolist() + (fy + 10).tolist()
    assert ds.test_y.tolist() == mty.tolist() + (fty + 10).tolist()
    both = np.concatenate([mx, fx]) / 255
    assert ds.mean[0] == pytest.approx(both.mean()) and ds.std[0] == pytest.approx(both.std())
    assert datasets.find_dataset("mnist-fashion", [tmp_path]) == tmp_path / "mnist"
    (tmp_path / "fashion-mnist" / datasets._MNIST_FILES[0]).unlink()
    with pytest.raises(DatasetNotFoundError, match="fashion-mnist"):
        load_dataset("mnist-fashion", [tmp_path])


def test_later_roots_are_searched(tmp_path):
    (tmp_path / "empty").mkdir()
    train_x, *_ = write_mnist(tmp_path / "full" / "mnist", gz=True)
    ds = load_dataset("mnist", [tmp_path / "empty", tmp_path / "full"])
    np.testing.assert_array_equal(ds.train_x[..., 0], train_x)


@pytest.mark.parametrize("gz", [True, False])
def test_emnist_letters_orientation_and_labels(tmp_path, gz):
    rng = np.random.default_rng(1)
    upright = rng.integers(0, 256, (52, 5, 4), dtype=np.uint8)  # non-square: a missed transpose changes the shape
    labels = (np.arange(52) % 26 + 1).astype(np.uint8)  # the raw letters labels are 1..26
    raw = tmp_path / "EMNIST" / "raw"
    for part in ("train", "test"):
        write_idx(raw / f"emnist-letters-{part}-images-idx3-ubyte", upright.transpose(0, 2, 1).copy(), gz)
        write_idx(raw / f"emnist-letters-{part}-labels-idx1-ubyte", labels, gz)
    ds = load_dataset("emnist-letters", [tmp_path])
    np.testing.assert_array_equal(ds.train_x[..., 0], upright)
    assert ds.train_y.min() == 0 and ds.train_y.max() == 25
    assert ds.train_y.tolist() == (labels.astype(np.int64) - 1).tolist()
    assert ds.num_classes == 26 and ds.class_names[0] == "a"


def test_emnist_balanced(tmp_path):
    rng = np.random.default_rng(2)
    labels = (np.arange(94) % 47).astype(np.uint8)
    for part in ("train", "test"):
        write_idx(tmp_path / "EMNIST" / "raw" / f"emnist-balanced-{part}-images-idx3-ubyte",
                  rng.integers(0, 256, (94, 28, 28), dtype=np.uint8), gz=False)  # fmt: skip
        write_idx(tmp_path / "EMNIST" / "raw" / f"emnist-balanced-{part}-labels-idx1-ubyte", labels, gz=False)
    ds = load_dataset("emnist-balanced", [tmp_path])
    assert ds.num_classes == 47 and ds.train_y.tolist() == labels.tolist()
    assert ds.class_names == EMNIST_CLASSES["balanced"]


# ---------------------------------------------------------------- CIFAR


def test_cifar10_pickles(tmp_path):
    rng = np.random.default_rng(3)
    chw = rng.integers(0, 256, (13, 3, 32, 32), dtype=np.uint8)
    labels = [i % 10 for i in range(13)]
    directory = tmp_path / "cifar-10-batches-py"
    for b in range(5):
        batch = {b"data": chw[2 * b : 2 * b + 2].reshape(2, -1), b"labels": labels[2 * b : 2 * b + 2]}
        write_pickle(directory / f"data_batch_{b + 1}", batch)
    write_pickle(directory / "test_batch", {b"data": chw[10:].reshape(3, -1), b"labels": labels[10:]})
    write_pickle(directory / "batches.meta", {b"label_names": [n.encode() for n in CIFAR10_NAMES]})
    ds = load_dataset("cifar10", [tmp_path])
    np.testing.assert_array_equal(ds.train_x, chw[:10].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(ds.test_x, chw[10:].transpose(0, 2, 3, 1))
    assert ds.train_y.tolist() == labels[:10] and ds.class_names == CIFAR10_NAMES
    assert ds.input_shape == (3, 32, 32) and len(ds.mean) == 3


def test_cifar100_pickles(tmp_path):
    rng = np.random.default_rng(4)
    directory = tmp_path / "cifar-100-python"
    names = [f"class{i:02d}".encode() for i in range(100)]
    for part, n in (("train", 6), ("test", 4)):
        write_pickle(directory / part, {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"fine_labels": [99 - i for i in range(n)],
            b"coarse_labels": [0] * n,
        })  # fmt: skip
    write_pickle(directory / "meta", {b"fine_label_names": names, b"coarse_label_names": [b"x"] * 20})
    ds = load_dataset("cifar100", [tmp_path])
    assert ds.train_x.shape == (6, 32, 32, 3) and ds.test_x.shape == (4, 32, 32, 3)
    assert ds.train_y.tolist() == [99, 98, 97, 96, 95, 94] and ds.class_names[5] == "class05"


def test_cifar10_jpeg_tarball_and_folder_agree(tmp_path):
    entries = cifar10_jpeg_entries()
    write_tar(tmp_path / "a" / "cifar10" / "cifar10-jpeg.tar.gz", entries)
    write_tree(tmp_path / "b" / "cifar10", entries)
    from_tar = load_dataset("cifar10", [tmp_path / "a"])
    from_folder = load_dataset("cifar10", [tmp_path / "b"])
    assert from_tar.class_names == CIFAR10_NAMES
    assert from_tar.train_x.shape == (20, 32, 32, 3) and from_tar.test_x.shape == (10, 32, 32, 3)
    assert from_tar.train_y.tolist() == sorted(list(range(10)) * 2)  # sorted by class, then file name
    first = np.asarray(Image.open(io.BytesIO(entries["train/airplane/0000.jpg"])).convert("RGB"))
    np.testing.assert_array_equal(from_tar.train_x[0], first)
    for a, b in ((from_tar.train_x, from_folder.train_x), (from_tar.test_y, from_folder.test_y)):
        np.testing.assert_array_equal(a, b)


def test_tiny_imagenet(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "tiny-imagenet-200"
    wnids = [f"n{i:08d}" for i in range(200)]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("".join(f"{w}\tthing {i}, other name\n" for i, w in enumerate(wnids)))
    for i, w in enumerate(wnids):
        (root / "train" / w / "images").mkdir(parents=True)
        mode = "L" if i == 1 else "RGB"  # Tiny-ImageNet has some grey images
        (root / "train" / w / "images" / f"{w}_0.JPEG").write_bytes(jpeg_bytes(rng, (64, 64), mode))
    lines = []
    for j, i in enumerate((7, 1, 7)):
        (root / "val" / "images" / f"val_{j}.JPEG").write_bytes(jpeg_bytes(rng, (64, 64)))
        lines.append(f"val_{j}.JPEG\t{wnids[i]}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    ds = load_dataset("tiny-imagenet", [tmp_path])
    assert ds.train_x.shape == (200, 64, 64, 3) and ds.input_shape == (3, 64, 64)
    assert ds.train_y.tolist() == list(range(200))
    assert ds.test_y.tolist() == [1, 7, 7]  # val split = test set, ordered by class then file
    assert ds.class_names[3] == "thing 3"
    grey = ds.train_x[1]
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()


# ---------------------------------------------------------------- cache


def _no_decoding(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("decoded although a valid cache exists")

    monkeypatch.setattr(dataset_formats, "_decode_rgb", fail)


def test_cache_is_used_and_invalidated(tmp_path, monkeypatch):
    tarball = write_tar(tmp_path / "cifar10" / "cifar10-jpeg.tar.gz", cifar10_jpeg_entries())
    first = load_dataset("cifar10", [tmp_path])
    cached = list((tmp_path / "cache").glob("cifar10-*"))
    assert len(cached) == 1 and not list((tmp_path / "cache").glob(".*"))  # no temp directory left
    with monkeypatch.context() as m:
        _no_decoding(m)
        again = load_dataset("cifar10", [tmp_path])
    np.testing.assert_array_equal(first.train_x, again.train_x)
    assert again.class_names == CIFAR10_NAMES
    # A changed source file (new mtime) is decoded again, under a new key.
    os.utime(tarball, ns=(time.time_ns(), tarball.stat().st_mtime_ns + 10**9))
    load_dataset("cifar10", [tmp_path])
    assert len(list((tmp_path / "cache").glob("cifar10-*"))) == 2


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_every_layout_is_memory_mapped_read_only_from_the_cache(tmp_path, name):
    """The decoded arrays are files the processes of a host map and share (the first load included)."""
    if name == "mnist":
        write_mnist(tmp_path / "mnist", gz=True)
    else:
        batches = {f: {b"data": np.full((2, 3072), i, np.uint8), b"labels": [i, 9 - i]}
                   for i, f in enumerate((*datasets._CIFAR10_BATCHES, "test_batch"))}
        for f, batch in batches.items():
            write_pickle(tmp_path / "cifar-10-batches-py" / f, batch)
        write_pickle(tmp_path / "cifar-10-batches-py" / "batches.meta",
                     {b"label_names": [n.encode() for n in CIFAR10_NAMES]})
    for ds in (load_dataset(name, [tmp_path]), load_dataset(name, [tmp_path])):
        for array in (ds.train_x, ds.train_y, ds.test_x, ds.test_y):
            assert isinstance(array.base, np.memmap) or isinstance(array, np.memmap)
            assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            ds.train_x[0, 0, 0, 0] = 1


def test_corrupt_cache_is_rebuilt(tmp_path):
    write_tar(tmp_path / "cifar10" / "cifar10-jpeg.tar.gz", cifar10_jpeg_entries())
    first = load_dataset("cifar10", [tmp_path])
    (cache,) = (tmp_path / "cache").glob("cifar10-*")
    # a new file, not the mapped one rewritten in place (truncating a mapped file faults its readers; the
    # cache itself only ever renames whole directories into place)
    (cache / "train_x.npy").unlink()
    (cache / "train_x.npy").write_bytes(b"not an array")
    again = load_dataset("cifar10", [tmp_path])
    np.testing.assert_array_equal(first.train_x, again.train_x)
    (cache,) = (tmp_path / "cache").glob("cifar10-*")  # replaced by a whole one
    np.testing.assert_array_equal(np.load(cache / "train_x.npy"), first.train_x)
    (cache / "class_names.json").write_text('{"not": "a list"}')
    assert load_dataset("cifar10", [tmp_path]).class_names == CIFAR10_NAMES


def test_an_unwritable_cache_keeps_the_arrays_in_memory(tmp_path, monkeypatch):
    (tmp_path / "cache-file").write_text("a file where the cache directory should be")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache-file"))
    train_x, *_ = write_mnist(tmp_path / "mnist", gz=False)
    ds = load_dataset("mnist", [tmp_path])
    np.testing.assert_array_equal(ds.train_x[..., 0], train_x)
    assert ds.train_x.flags.writeable  # decoded, in memory


# ---------------------------------------------------------------- bad inputs


def test_missing_dataset_message(tmp_path):
    roots = [tmp_path / "r1", tmp_path / "r2"]
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("cifar10", roots)
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "'cifar10'" in message and "--download" in message and "torchvision" in message
    for root in roots:
        for where in ("cifar10/cifar10-jpeg.tar.gz", "cifar10/train", "cifar-10-batches-py"):
            assert str(root / where) in message
    assert len(info.value.looked_at) == 6


def test_missing_tiny_imagenet_says_where_to_get_it(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"tiny-imagenet-200\.zip"):
        load_dataset("tiny-imagenet", [tmp_path])


def test_unknown_dataset_name(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        load_dataset("svhn", [tmp_path])


def test_download_without_torchvision(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    with pytest.raises(ImportError, match="pip install torchvision"):
        load_dataset("mnist", [tmp_path], download=True)


def test_download_uses_torchvision_layout(tmp_path, monkeypatch):
    calls = []

    def fake_mnist(root, download):
        calls.append((root, download))
        write_mnist(Path(root) / "MNIST" / "raw", gz=False)

    fake = types.ModuleType("torchvision.datasets")
    fake.MNIST = fake_mnist
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake)
    ds = load_dataset("mnist", [tmp_path / "dl", tmp_path / "other"], download=True)
    assert calls == [(str(tmp_path / "dl"), True)] and len(ds.train_y) == 30


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda good: b"\x08\x03" + good[2:], "bad magic"),
        (lambda good: good[:2] + b"\x0c" + good[3:], "not unsigned byte"),
        (lambda good: good[:-7], "truncated"),
        (lambda good: good + b"\0", "truncated or corrupt"),
        (lambda good: good[:6], "truncated"),
    ],
    ids=["magic", "dtype", "short-data", "extra-data", "short-header"],
)
def test_corrupt_idx(tmp_path, corrupt, message):
    path = write_idx(tmp_path / "x-idx3-ubyte", mnist_arrays()[0])
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(DatasetFormatError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_truncated_gzip_idx(tmp_path):
    path = write_idx(tmp_path / "train-images-idx3-ubyte", mnist_arrays()[0], gz=True)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DatasetFormatError, match=str(path)):
        read_idx(path)


def test_corrupt_file_in_dataset_is_an_error(tmp_path):
    images = tmp_path / "mnist" / "train-images-idx3-ubyte"
    write_mnist(tmp_path / "mnist", gz=False)
    images.write_bytes(images.read_bytes()[:100])
    with pytest.raises(DatasetFormatError, match="train-images"):
        load_dataset("mnist", [tmp_path])


def test_image_label_count_mismatch(tmp_path):
    write_mnist(tmp_path / "mnist", gz=True)
    write_idx(tmp_path / "mnist" / "train-labels-idx1-ubyte", np.zeros(29, np.uint8), gz=True)
    with pytest.raises(DatasetFormatError, match="30 images but 29 labels"):
        load_dataset("mnist", [tmp_path])


def test_corrupt_cifar_pickle(tmp_path):
    directory = tmp_path / "cifar-100-python"
    for part in ("train", "test", "meta"):
        write_pickle(directory / part, {})
    (directory / "train").write_bytes(b"garbage")
    with pytest.raises(DatasetFormatError, match="train"):
        load_dataset("cifar100", [tmp_path])


def test_image_dataset_checks_its_arrays():
    x = np.zeros((2, 3, 3, 1), np.uint8)
    with pytest.raises(ValueError, match="train_y"):
        ImageDataset("mnist", x, np.array([0, 10]), x, np.array([0, 1]), 10, tuple("0123456789"), (0.0,), (1.0,))


# ---------------------------------------------------------------- the real shared data


def real_roots() -> list[Path]:
    return datasets.roots_from_env() or [Path(__file__).resolve().parents[2] / "shared" / "data"]


def load_real(name: str) -> ImageDataset:
    try:
        return load_dataset(name, real_roots())
    except DatasetNotFoundError as e:
        pytest.skip(f"dataset {name!r} is absent; looked at {', '.join(map(str, e.looked_at))}")


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_real_mnist_family(name):
    ds = load_real(name)
    assert ds.train_x.shape == (60000, 28, 28, 1) and ds.test_x.shape == (10000, 28, 28, 1)
    assert np.bincount(ds.train_y).min() > 5000 and np.bincount(ds.test_y).sum() == 10000
    expected_mean = {"mnist": 0.1307, "fashion-mnist": 0.2860}[name]
    assert ds.mean[0] == pytest.approx(expected_mean, abs=1e-3)


@pytest.mark.slow
def test_real_cifar10_tarball_decoded_once(tmp_path, monkeypatch):
    ds = load_real("cifar10")

    def decode_again(path):
        raise AssertionError(f"{path} decoded a second time instead of read from the cache")
    monkeypatch.setattr(datasets, "read_image_tar", decode_again)
    again = load_real("cifar10")  # from the cache written by the first load
    assert ds.train_x.shape == (50000, 32, 32, 3) and ds.test_x.shape == (10000, 32, 32, 3)
    assert ds.class_names == CIFAR10_NAMES
    assert np.bincount(ds.train_y).tolist() == [5000] * 10 and np.bincount(ds.test_y).tolist() == [1000] * 10
    assert ds.mean == pytest.approx((0.4914, 0.4822, 0.4465), abs=0.01)
    np.testing.assert_array_equal(ds.test_x, again.test_x)


def test_dataset_names():
    required = {"mnist", "fashion-mnist", "emnist-letters", "emnist-balanced", "cifar10", "cifar100", "tiny-imagenet"}
    assert required <= set(DATASETS)

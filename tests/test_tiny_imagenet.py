"""Tiny-ImageNet-32: its tarball's layout read from small fixtures packed like the real one, the message when it
is missing, and a smoke run on the real shared copy (10 tasks of 20 classes)."""

from __future__ import annotations

import io
import json
import typing

import numpy as np
import pytest
import yaml
from PIL import Image

from fcl_emu.scenario.dataset_cache import CACHE_DIR_ENV
from fcl_emu.scenario.dataset_formats import DatasetFormatError, read_image_folder, read_image_tar
from fcl_emu.scenario.datasets import DatasetNotFoundError, find_dataset, load_dataset
from fcl_emu.scenario.scenario import build_scenario
from fcl_emu.scenario.spec import Partition, ScenarioSpec
from tests.conftest import fcl_emu, find_dataset_root
from tests.test_scenario_build import fake_dataset
from tests.test_scenario_datasets import write_tar

TARBALL = "tiny-imagenet-32-jpeg.tar.gz"
# in the real classes.txt's order (not sorted), with its comma-separated synonyms
WORDS = {"n02124075": "Egyptian cat", "n01443537": "goldfish, Carassius auratus", "n04067472": "reel"}


def jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def entries(words: dict[str, str], train: int = 2, test: int = 1) -> dict[str, bytes]:
    """The real tarball's members: ``classes.txt`` and ``{train,test}/<wnid>/NNNN.jpg``."""
    files = {"classes.txt": "".join(f"{w}\t{text}\n" for w, text in words.items()).encode()}
    for c, wnid in enumerate(words):
        for split, n in (("train", train), ("test", test)):
            files.update({f"{split}/{wnid}/{i:04d}.jpg": jpeg(1000 * c + 10 * i + len(split)) for i in range(n)})
    return files


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """The fixtures' decoded arrays cached in the test's own directory (the smoke run keeps the usual cache: the
    real tarball is decoded once)."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))


def test_tarball_layout_names_classes_from_classes_txt(tmp_path):
    files = entries(WORDS)
    tarball = write_tar(tmp_path / TARBALL, files)
    for name, data in files.items():
        (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / name).write_bytes(data)
    a, b = read_image_tar(tarball, named=True), read_image_folder(tmp_path / "tree", named=True)
    # labels: the rank of the sorted wnid (as every image-folder tree); names: the first of classes.txt's words
    assert a.class_names == ("goldfish", "Egyptian cat", "reel") == b.class_names
    assert a.train_y.tolist() == [0, 0, 1, 1, 2, 2] and a.test_y.tolist() == [0, 1, 2]
    assert a.train_x.shape == (6, 32, 32, 3) and a.test_x.shape == (3, 32, 32, 3)
    first = np.asarray(Image.open(io.BytesIO(files["train/n01443537/0000.jpg"])).convert("RGB"))
    np.testing.assert_array_equal(a.train_x[0], first)
    np.testing.assert_array_equal(a.train_x, b.train_x)
    # without named, the folders name the classes (CIFAR-10's tarball)
    assert read_image_tar(tarball).class_names == tuple(sorted(WORDS))


def test_classes_txt_must_name_exactly_the_folders(tmp_path):
    files = entries(WORDS)
    files["classes.txt"] = b"n01443537\tgoldfish\nn02124075\tEgyptian cat\n"
    with pytest.raises(DatasetFormatError, match=r"names 2 classes, the images 3.*unnamed: \['n04067472'\]"):
        read_image_tar(write_tar(tmp_path / "a.tar.gz", files), named=True)
    del files["classes.txt"]
    with pytest.raises(DatasetFormatError, match="no classes.txt"):
        read_image_tar(write_tar(tmp_path / "b.tar.gz", files), named=True)
    files["classes.txt"] = b"n01443537 goldfish\n"
    with pytest.raises(DatasetFormatError, match="line 1"):
        read_image_tar(write_tar(tmp_path / "c.tar.gz", files), named=True)


def test_load_dataset_finds_the_tarball_under_the_data_root(tmp_path, tmp_cache):
    words = {f"n{i:08d}": f"thing {i}, other" for i in range(200)}
    write_tar(tmp_path / "tiny-imagenet-32" / TARBALL, entries(words, train=1, test=1))
    assert find_dataset("tiny-imagenet-32", [tmp_path]) == tmp_path / "tiny-imagenet-32" / TARBALL
    ds = load_dataset("tiny-imagenet-32", [tmp_path])
    assert ds.num_classes == 200 and ds.input_shape == (3, 32, 32) and ds.class_names[7] == "thing 7"
    assert len(ds.train_x) == 200 and isinstance(ds.train_x, np.memmap)  # from the cache, memory-mapped


def test_few_classes_are_refused_by_the_registry(tmp_path, tmp_cache):
    write_tar(tmp_path / "tiny-imagenet-32" / TARBALL, entries(WORDS))
    with pytest.raises(DatasetFormatError, match="found 3 classes, expected 200"):
        load_dataset("tiny-imagenet-32", [tmp_path])


def test_missing_dataset_says_where_to_put_it_and_how_to_build_it(tmp_path, tmp_cache):
    for download in (False, True):
        with pytest.raises(DatasetNotFoundError) as raised:
            load_dataset("tiny-imagenet-32", [tmp_path], download=download)
        message = str(raised.value)
        assert str(tmp_path / "tiny-imagenet-32" / TARBALL) in message and "has no download" in message
        assert "tiny-imagenet-200.zip" in message and "classes.txt" in message


@pytest.mark.slow
def test_smoke_run_ten_tasks_of_twenty_classes(tmp_path):
    """`fcl-emu up --dataset tiny-imagenet-32 --tasks 10` on the real copy: 200 classes, 10 tasks of 20, one
    round each, a few samples per client."""
    root = find_dataset_root(f"tiny-imagenet-32/{TARBALL}")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "scenario": {"partition": "iid", "samples_per_client_task": 8},
        "rounds": {"clients_per_round": 2, "rounds_per_task": 1, "eval_every": 1},
        "training": {"local_epochs": 1, "batch_size": 8},
        "model": "cnn", "device": "cpu",
    }))
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--dataset", "tiny-imagenet-32", "--tasks", "10", "--clients", "2",
                   "--nodes", "1", "--data-root", str(root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=900) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["dataset"] == "tiny-imagenet-32"
    matrix = summary["accuracy_matrix"]
    assert len(matrix) == 10 and all(len(row) == 10 for row in matrix)
    assert all(v is not None for t, row in enumerate(matrix) for v in row[: t + 1])  # every task evaluated
    # the run's own scenario, rebuilt from its summary over the cached arrays: 200 classes, 10 tasks of 20
    dataset = load_dataset("tiny-imagenet-32", [root])
    assert "goldfish" in dataset.class_names and "n01443537" not in dataset.class_names  # LANDER's label texts
    scenario = build_scenario(ScenarioSpec(**summary["scenario"]), dataset)
    assert scenario.num_classes == 200 and scenario.num_tasks == 10
    assert [len(scenario.task_classes(t)) for t in range(10)] == [20] * 10
    assert sorted(np.concatenate([scenario.task_classes(t) for t in range(10)])) == list(range(200))
    assert sorted(scenario.class_order) == list(range(200))


@pytest.mark.parametrize("partition", typing.get_args(Partition))
def test_every_partition_splits_its_200_classes(partition):
    """200 classes of a few samples each, as the registry names them: 10 tasks of 20 under every partition."""
    dataset = fake_dataset("tiny-imagenet-32", 200, per_class=10)
    s = build_scenario(ScenarioSpec(dataset="tiny-imagenet-32", num_tasks=10, num_clients=6, partition=partition),
                       dataset)
    assert s.num_classes == 200
    for t in range(10):
        assert sum(len(s.client_indices(c, t)) for c in s.active_clients(t)) > 0
    if partition not in ("task_pool", "accessible_classes"):  # those evaluate the classes in order of first use
        assert [len(s.task_classes(t)) for t in range(10)] == [20] * 10

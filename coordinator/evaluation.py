"""Evaluating the global model on the test samples of each task seen so far."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fcl_emu.monitoring.results import client_test_accuracy
from fcl_emu.scenario.transforms import to_tensor


CPU_BATCH = 128  # on the CPU: the activations of a batch stay in cache (see Evaluator)
DEVICE_BATCH = 1000


class Evaluator:
    """Scores a model per task (class-incremental) on the test set, normalising it batch by batch.

    Batches of ``CPU_BATCH`` on the CPU: with the ``cnn`` on MNIST's test set, one thread, a batch of 128
    costs 0.6 s of CPU per evaluation and 20-30 MB above the idle process, a batch of 1000 2.3 s and
    200-270 MB (its 28x28x64 activations alone are 200 MB), the coordinator's largest memory peak. The test
    images stay uint8 and are normalised batch by batch (MNIST's as float32: 31 MB more, held all run).
    """

    def __init__(self, scenario, device: torch.device, batch_size: int | None = None):
        self.scenario = scenario
        self.device = device
        self.batch_size = batch_size or (CPU_BATCH if device.type == "cpu" else DEVICE_BATCH)
        self.dataset = scenario.dataset
        self.y = torch.tensor(scenario.test_labels, dtype=torch.long)

    @torch.inference_mode()
    def predictions(self, model: nn.Module, indices: np.ndarray) -> torch.Tensor:
        """Predicted labels of the test samples ``indices``. Images go through a channels-last copy of the
        model (oneDNN's fast layout for convolutions on the CPU: about twice as fast here, the same
        predictions); the model itself is left as it is."""
        model.to(self.device).eval()
        model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        ds = self.dataset
        predicted = torch.empty(len(indices), dtype=torch.long)  # allocated first: nothing small outlives a batch
        for i in range(0, len(indices), self.batch_size):
            batch = to_tensor(ds.test_x[indices[i:i + self.batch_size]], ds.mean, ds.std)
            batch = batch.to(self.device).contiguous(memory_format=torch.channels_last)
            predicted[i:i + len(batch)] = model(batch).argmax(1).cpu()
        return predicted

    def class_hits(self, model: nn.Module, task: int) -> tuple[np.ndarray, np.ndarray]:
        """Correct predictions and test samples of each class seen up to ``task`` (index = incremental label),
        predicting over all seen classes: one pass over the seen classes' test samples."""
        classes = self.scenario.seen_classes(task)
        indices = self.scenario.test_indices(classes)
        labels = self.y[torch.from_numpy(indices)]
        correct = self.predictions(model, indices) == labels
        size = len(classes)
        hits = torch.bincount(labels[correct], minlength=size)[:size].numpy()
        return hits, torch.bincount(labels, minlength=size)[:size].numpy()

    def accuracy_per_task(self, hits: np.ndarray, totals: np.ndarray, last_task: int) -> list[float | None]:
        """Accuracy (percent) on each task 0..last_task's classes from :meth:`class_hits`; ``None`` for a task
        that introduced no class (possible when clients follow their own task sequences)."""
        accs = []
        for t in range(last_task + 1):
            classes = self.scenario.task_classes(t)
            total = int(totals[classes].sum())
            accs.append(100.0 * float(hits[classes].sum()) / total if total else None)
        return accs

    def client_task_classes(self, task: int) -> list[list[np.ndarray]]:
        """For every client that has joined by ``task``: the classes of its data at each task ``0..task``."""
        return [[self.scenario.client_classes(k, t) for t in range(task + 1)]
                for k in self.scenario.active_clients(task)]

    def client_accuracy(self, hits: np.ndarray, totals: np.ndarray, task: int) -> float | None:
        """AF-FCL's accuracy on every client's own test sets after ``task`` (``accuracy_clients``,
        :func:`fcl_emu.monitoring.results.client_test_accuracy`) from :meth:`class_hits`."""
        return client_test_accuracy(hits, totals, self.client_task_classes(task))

    def accuracy_seen(self, model: nn.Module, task: int) -> float:
        """Accuracy (percent) on all test samples of the classes seen up to ``task``."""
        hits, totals = self.class_hits(model, task)
        return 100.0 * float(hits.sum()) / float(totals.sum())

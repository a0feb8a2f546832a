"""Evaluating the global model on the test samples of each task seen so far."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from monitoring.results import client_test_accuracy
from scenario.transforms import to_tensor


class Evaluator:
    """Holds the normalised test set once; scores a model per task (class-incremental)."""

    def __init__(self, scenario, device: torch.device, batch_size: int = 1000):
        self.scenario = scenario
        self.device = device
        self.batch_size = batch_size
        ds = scenario.dataset
        self.x = to_tensor(ds.test_x, ds.mean, ds.std)
        self.y = torch.tensor(scenario.test_labels, dtype=torch.long)

    @torch.inference_mode()
    def predictions(self, model: nn.Module, indices: np.ndarray) -> torch.Tensor:
        """Predicted labels of the test samples ``indices``. Images go through a channels-last copy of the
        model (oneDNN's fast layout for convolutions on the CPU: about twice as fast here, the same
        predictions); the model itself is left as it is."""
        model.to(self.device).eval()
        layout = torch.channels_last if self.x.dim() == 4 else torch.contiguous_format
        if layout is torch.channels_last:
            model = copy.deepcopy(model).to(memory_format=layout)
        out = []
        for i in range(0, len(indices), self.batch_size):
            idx = torch.from_numpy(indices[i:i + self.batch_size])
            batch = self.x[idx].to(self.device).contiguous(memory_format=layout)
            out.append(model(batch).argmax(1).cpu())
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

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
        :func:`monitoring.results.client_test_accuracy`) from :meth:`class_hits`."""
        return client_test_accuracy(hits, totals, self.client_task_classes(task))

    def accuracy_seen(self, model: nn.Module, task: int) -> float:
        """Accuracy (percent) on all test samples of the classes seen up to ``task``."""
        hits, totals = self.class_hits(model, task)
        return 100.0 * float(hits.sum()) / float(totals.sum())

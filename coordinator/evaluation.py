"""Evaluating the global model on the test samples of each task seen so far."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

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

    @torch.no_grad()
    def predictions(self, model: nn.Module, indices: np.ndarray) -> torch.Tensor:
        model.to(self.device).eval()
        out = []
        for i in range(0, len(indices), self.batch_size):
            idx = torch.from_numpy(indices[i:i + self.batch_size])
            out.append(model(self.x[idx].to(self.device)).argmax(1).cpu())
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

    def accuracy_per_task(self, model: nn.Module, last_task: int) -> list[float]:
        """Accuracy (percent) on each task 0..last_task's classes, predicting over all seen classes."""
        accs = []
        for t in range(last_task + 1):
            indices = self.scenario.test_indices(self.scenario.task_classes(t))
            pred = self.predictions(model, indices)
            accs.append(100.0 * float((pred == self.y[torch.from_numpy(indices)]).float().mean()) if len(indices) else float("nan"))
        return accs

    def accuracy_seen(self, model: nn.Module, task: int) -> float:
        """Accuracy (percent) on all test samples of the classes seen up to ``task``."""
        indices = self.scenario.test_indices(self.scenario.seen_classes(task))
        pred = self.predictions(model, indices)
        return 100.0 * float((pred == self.y[torch.from_numpy(indices)]).float().mean())

"""The ``training`` values a data set brings where a run's config and its method leave them unset (before the
defaults of :class:`~fcl_emu.runconfig.config.TrainingConfig`, which suit MNIST, Fashion-MNIST and EMNIST).

On colour images the ``auto`` model (``cnn_bn``) needs a smaller step: at lr 0.05 with momentum 0.9 one round of
FedAvg on Tiny-ImageNet-32 ends at chance, at 0.01 well above (docs/scenarios.md has the pilot runs).
"""

from __future__ import annotations

from typing import Any

DATASET_TRAINING: dict[str, dict[str, float]] = {
    name: {"lr": 0.01} for name in ("cifar10", "cifar100", "tiny-imagenet", "tiny-imagenet-32")}


def dataset_training(scenario: Any) -> dict[str, float]:
    """The ``training`` values of the data set that a config's ``scenario`` (a mapping or a ScenarioSpec) names."""
    dataset = scenario.get("dataset") if isinstance(scenario, dict) else getattr(scenario, "dataset", None)
    return DATASET_TRAINING.get(str(dataset), {})

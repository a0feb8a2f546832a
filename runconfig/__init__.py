"""The run configuration: the one validated object every part of a run reads.

It sits below the coordinator, the edge node and the command line (which
builds it from flags and YAML, :mod:`fcl_emu.options`); it may import only the
scenario and the method registry, to validate names and combinations, and the
SecAgg+ settings it embeds (:class:`fcl_emu.secagg.settings.SecAggSettings`).
"""

from fcl_emu.runconfig.config import (EdgeConfig, GpuSettings, MetricsConfig, NetworkConfig, RoundConfig, RunConfig,
                              TrainingConfig, default_data_roots, load_config)
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.runconfig.ports import gpu_worker_metrics_port, metrics_ports, node_metrics_port

__all__ = ["EdgeConfig", "GpuSettings", "MetricsConfig", "NetworkConfig", "RoundConfig", "RunConfig", "SecAggSettings",
           "TrainingConfig", "default_data_roots", "load_config", "gpu_worker_metrics_port", "metrics_ports",
           "node_metrics_port"]

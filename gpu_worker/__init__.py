"""The GPU worker: one process that runs the coordinator's server-side jobs on one device (docs/gpu.md), its
arguments, and whether a CUDA device asked for is there. This is the one door the coordinator, the command line and
the benchmarks use: ``from fcl_emu.gpu_worker import ...``; ``python -m fcl_emu.gpu_worker FLAGS`` runs one worker.

- :mod:`~fcl_emu.gpu_worker.worker`: the process (its identity, its device, serving jobs);
- :mod:`~fcl_emu.gpu_worker.args`: :class:`GpuWorkerArgs`, its flags;
- :mod:`~fcl_emu.gpu_worker.devices`: the CUDA check of ``--device``, ``--gpu-device`` and the benchmarks.
"""

from fcl_emu.gpu_worker.args import GpuWorkerArgs
from fcl_emu.gpu_worker.devices import DeviceError, check_cuda, no_cuda
from fcl_emu.gpu_worker.worker import WORKER_KEY_NAME, main, run_worker, serve, worker_device, worker_identity

__all__ = ["DeviceError", "GpuWorkerArgs", "WORKER_KEY_NAME", "check_cuda", "main", "no_cuda", "run_worker", "serve",
           "worker_device", "worker_identity"]

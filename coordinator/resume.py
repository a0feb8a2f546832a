"""Checkpoints and resuming: what the coordinator saves after every round and how it takes it back.

:meth:`Checkpointing._save_checkpoint` writes the method's server state, the RNGs, the client registry and the
results so far (atomically, :mod:`coordinator.checkpoint`); a coordinator built with ``resume=`` takes them over
(:meth:`Checkpointing._restore`), waits for the clients online at the checkpoint to join again
(:meth:`Checkpointing._wait_for_rejoin`) and goes on with the next round (docs/resume.md).

A mixin of :class:`coordinator.engine.Coordinator`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from coordinator import checkpoint
from coordinator.checkpoint import Checkpoint
from coordinator.errors import RunAborted
from monitoring.results import RoundRecord
from runconfig import RunConfig

log = logging.getLogger("fcl_emu.coordinator")

CHECKPOINT_DIR = "checkpoint"  # in the run directory (docs/resume.md)
SERVER, TORCH_RNG, CUDA_RNG = "server/", "rng/torch", "rng/cuda/"  # checkpoint array names


def run_fingerprint(config: RunConfig) -> str:
    """A hash of what decides a run's results: the config less data location, metrics, run directory, the GPU
    pool's size and device, the coordinator's threads, where the edge nodes run, and the transport's keys."""
    data = config.model_dump(mode="json", exclude={"metrics": True, "data_root": True, "run_dir": True,
                                                   "download": True, "gpu": True, "containers": True,
                                                   "coordinator_threads": True,
                                                   "security": {"transport", "keys"}})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class Checkpointing:
    """Saving a checkpoint after every round, taking one over, waiting for the clients to rejoin (mixin of
    Coordinator)."""

    def _save_checkpoint(self, run_dir: Path, task: int, task_round: int, matrix: list, rounds: list[RoundRecord],
                         wall_s: float) -> None:
        """Checkpoint atomically (docs/resume.md). ``(task, task_round)`` is the next round to run: task_round 0
        means the task has not started (its head is not grown yet); task == num_tasks, the run is complete."""
        t0 = time.perf_counter()
        arrays = {SERVER + k: v for k, v in self.server.state_arrays().items()}
        arrays[TORCH_RNG] = torch.get_rng_state().numpy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                arrays[f"{CUDA_RNG}{i}"] = state.numpy()
        state = {
            "run_id": self.run_id, "address": self.address, "fingerprint": run_fingerprint(self.config),
            "method": self.config.method, "saved_at": time.time(),
            "next": {"task": task, "task_round": task_round}, "global_round": self._global_round,
            "complete": task >= self.scenario.num_tasks,
            "wall_clock_s": wall_s, "run_clock_s": time.monotonic() - self._clock0,
            "emulated_clock_s": None if self.clock is None else self.clock.now,
            "rng": {"numpy": self.rng.bit_generator.state},
            "server": self.server.state_meta(),
            "registry": self.registry.snapshot(),
            "results": {
                "matrix": matrix, "rounds": [asdict(r) for r in rounds],
                "bytes": [[t, d, n] for (t, d), n in self.counters.bytes.items()],
                "messages": [[t, d, n] for (t, d), n in self.counters.messages.items()],
                "rejected": dict(self.rejected), "handling_s": dict(self.handling_s),
                "late_updates": self.late_updates, "late_side_channel": self.late_side_channel,
                "client_accuracy": self.client_accuracy,
            },
            "resumes": self._resumes,
            "checkpoints": {**self._checkpoints, "saved": self._checkpoints["saved"] + 1},  # this one included
        }
        nbytes = checkpoint.save(run_dir / CHECKPOINT_DIR, state, arrays)
        elapsed = time.perf_counter() - t0
        self._checkpoints = {"saved": self._checkpoints["saved"] + 1,
                             "seconds": self._checkpoints["seconds"] + elapsed, "bytes": nbytes}
        log.debug("checkpoint before task %d round %d: %d bytes in %.3f s", task, task_round, nbytes, elapsed)

    def _restore(self, ckpt: Checkpoint) -> None:
        """Take over a checkpoint's state (the constructor's last step); run() continues after it."""
        s, arrays = ckpt.state, ckpt.arrays
        if s.get("fingerprint") != run_fingerprint(self.config):
            raise checkpoint.CheckpointError("the checkpoint was written under another configuration "
                                             "than this one (was config.yaml edited?)")
        try:
            self.server.load_state_arrays({k[len(SERVER):]: v for k, v in arrays.items() if k.startswith(SERVER)})
            self.server.load_state_meta(s["server"])
            # after the server: loading never draws from torch's RNG, but be sure nothing comes after this
            torch.set_rng_state(torch.from_numpy(np.array(arrays[TORCH_RNG])))
            cuda = [torch.from_numpy(np.array(v)) for k, v in sorted(arrays.items()) if k.startswith(CUDA_RNG)]
            if cuda and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(cuda)
            self.rng.bit_generator.state = s["rng"]["numpy"]
            self.registry.restore(s["registry"])
            res = s["results"]
            for t, d, n in res["bytes"]:
                self.counters.bytes[(t, d)] = n
            for t, d, n in res["messages"]:
                self.counters.messages[(t, d)] = n
            self.rejected.update(res["rejected"])
            self.handling_s.update(res["handling_s"])
            self.late_updates = res["late_updates"]
            self.late_side_channel = res["late_side_channel"]
            # a checkpoint written before accuracy_clients existed: unknown for its finished tasks
            self.client_accuracy = res.get("client_accuracy", [None] * len(res["matrix"]))
            self._global_round = s["global_round"]
            self._task = min(s["next"]["task"], self.scenario.num_tasks - 1)
            self._clock0 = time.monotonic() - s["run_clock_s"]
            if self.clock is not None:  # crash downtimes in flight are not kept (docs/resume.md)
                self.clock.now = s.get("emulated_clock_s") or 0.0
            self._resumes = s["resumes"] + 1
            self._checkpoints = {"saved": s["checkpoints"]["saved"], "seconds": s["checkpoints"]["seconds"],
                                 "bytes": s["checkpoints"]["bytes"]}
            self._resumed = {"task": s["next"]["task"], "task_round": s["next"]["task_round"],
                             "matrix": res["matrix"], "rounds": [RoundRecord(**r) for r in res["rounds"]],
                             "wall_clock_s": s["wall_clock_s"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise checkpoint.CheckpointError(f"corrupt checkpoint: cannot restore it ({type(exc).__name__}: "
                                             f"{exc})") from None

    def _wait_for_rejoin(self) -> list[str]:
        """After a resume: serve until the clients online at the checkpoint have joined again (their DEALERs
        reconnect on their own; any message of theirs is answered ``not_joined``). Stops early once none has
        come back for ``liveness_timeout_s`` after the first did (clients away for now), and at
        ``join_timeout_s``. Returns the clients that did not come back; they count as dropped."""
        net = self.config.network
        seen = {"awaiting": self.registry.awaiting_rejoin, "changed": None}

        def settled() -> bool:
            awaiting, now = self.registry.awaiting_rejoin, time.monotonic()
            if awaiting != seen["awaiting"]:
                seen.update(awaiting=awaiting, changed=now)
            return awaiting == 0 or (seen["changed"] is not None and now - seen["changed"] > net.liveness_timeout_s)

        self.serve(settled, time.monotonic() + net.join_timeout_s)
        missing = self.registry.drop_resumed()
        for _ in missing:
            self.metrics.client_dropped("heartbeat_timeout")
        online = len(self.registry.eligible(self._task))
        if online < self.config.rounds.min_participants:
            raise RunAborted(f"only {online} clients joined the resumed coordinator within "
                             f"{net.join_timeout_s:.0f} s; at least {self.config.rounds.min_participants} are needed")
        self.progress("ready", {"online": len(self.registry.online()), "expected": self.config.scenario.num_clients})
        return missing

"""Checkpoints and resuming: what the coordinator saves after every round and how it takes it back.

:meth:`Checkpointer.save` writes the method's server state, the RNGs, the client registry and the results so
far (atomically, :mod:`fcl_emu.coordinator.checkpoint`); a coordinator built with ``resume=`` takes them over
(:meth:`Checkpointer.restore`), waits for the clients online at the checkpoint to join again
(:meth:`Checkpointer.wait_for_rejoin`) and goes on with the next round (docs/resume.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fcl_emu.coordinator import checkpoint
from fcl_emu.coordinator.checkpoint import Checkpoint
from fcl_emu.coordinator.clock import RunClock, Serve
from fcl_emu.coordinator.contracts import RunAborted
from fcl_emu.coordinator.state import RunState
from fcl_emu.monitoring.results import RoundRecord
from fcl_emu.runconfig import RunConfig, legacy

log = logging.getLogger("fcl_emu.coordinator")

CHECKPOINT_DIR = "checkpoint"  # in the run directory (docs/resume.md)
SERVER, POLICY, TORCH_RNG, CUDA_RNG = "server/", "policy/", "rng/torch", "rng/cuda/"  # checkpoint array names


def run_fingerprint(config: RunConfig) -> str:
    """A hash of what decides a run's results: the config less data location, metrics, run directory, the GPU
    pool's size and device, the coordinator's threads, where the edge nodes run, the transport's keys, the nodes'
    model check, whether late trainings are cancelled (``rounds.skip_late``: the same results with less host work)
    and whether a diverged DP run stops (``privacy.on_divergence``: the same rounds, up to the stop); the server optimiser's
    settings only where one is chosen; aggregation's settings in their old layout (:func:`~fcl_emu.runconfig.legacy.
    as_legacy`), so that checkpoints from before still match."""
    data = config.model_dump(mode="json", exclude={"metrics": True, "data_root": True, "run_dir": True,
                                                   "download": True, "gpu": True, "containers": True,
                                                   "coordinator_threads": True, "rounds": {"skip_late"},
                                                   "security": {"transport", "keys"}, "secagg": {"model_check"},
                                                   "privacy": {"on_divergence"}})
    data = legacy.as_legacy(data)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Resumed:
    """Where a resumed run goes on: the next round and the results so far."""

    task: int
    task_round: int
    matrix: list[list[float | None]]
    rounds: list[RoundRecord]
    wall_clock_s: float


class Checkpointer:
    """Saving a checkpoint after every round, taking one over, waiting for the clients to rejoin."""

    def __init__(self, state: RunState, clock: RunClock, address: str):
        self.state, self.clock, self.address = state, clock, address
        self.resumes = 0
        self.stats = {"saved": 0, "seconds": 0.0, "bytes": 0}  # saved, seconds in total, bytes of the latest

    def save(self, run_dir: Path, task: int, task_round: int, matrix: list, rounds: list[RoundRecord],
             wall_s: float) -> None:
        """Checkpoint atomically (docs/resume.md). ``(task, task_round)`` is the next round to run: task_round 0
        means the task has not started (its head is not grown yet); task == num_tasks, the run is complete."""
        st = self.state
        t0 = time.perf_counter()
        arrays = {SERVER + k: v for k, v in st.server.state_arrays().items()}
        arrays.update({POLICY + k: v for k, v in st.policy.state_arrays().items()})
        arrays[TORCH_RNG] = torch.get_rng_state().numpy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                arrays[f"{CUDA_RNG}{i}"] = state.numpy()
        tally = st.tally
        state = {
            "run_id": st.run_id, "address": self.address, "fingerprint": run_fingerprint(st.config),
            "method": st.config.method, "saved_at": time.time(),
            "next": {"task": task, "task_round": task_round}, "global_round": st.global_round,
            "complete": task >= st.scenario.num_tasks,
            "wall_clock_s": wall_s, **self.clock.checkpoint_fields(),
            "rng": {"numpy": st.rng.bit_generator.state},
            "server": st.server.state_meta(),
            "registry": st.registry.snapshot(),
            "results": {
                "matrix": matrix, "rounds": [asdict(r) for r in rounds],
                "bytes": [[t, d, n] for (t, d), n in st.counters.bytes.items()],
                "messages": [[t, d, n] for (t, d), n in st.counters.messages.items()],
                "rejected": dict(tally.rejected), "handling_s": dict(tally.handling_s),
                "late_updates": tally.late_updates, "late_side_channel": tally.late_side_channel,
                "client_accuracy": st.client_accuracy,
            },
            "resumes": self.resumes,
            "checkpoints": {**self.stats, "saved": self.stats["saved"] + 1},  # this one included
        }
        nbytes = checkpoint.save(run_dir / CHECKPOINT_DIR, state, arrays)
        elapsed = time.perf_counter() - t0
        self.stats = {"saved": self.stats["saved"] + 1, "seconds": self.stats["seconds"] + elapsed,
                      "bytes": nbytes}
        log.debug("checkpoint before task %d round %d: %d bytes in %.3f s", task, task_round, nbytes, elapsed)

    def restore(self, ckpt: Checkpoint) -> Resumed:
        """Take over a checkpoint's state (the coordinator's last step of construction); returns where the run
        goes on."""
        s, arrays, st = ckpt.state, ckpt.arrays, self.state
        if s.get("fingerprint") != run_fingerprint(st.config):
            raise checkpoint.CheckpointError("the checkpoint was written under another configuration "
                                             "than this one (was config.yaml edited?)")
        try:
            st.server.load_state_arrays({k[len(SERVER):]: v for k, v in arrays.items() if k.startswith(SERVER)})
            st.server.load_state_meta(s["server"])
            st.policy.load_state_arrays({k[len(POLICY):]: v for k, v in arrays.items() if k.startswith(POLICY)})
            # after the server: loading never draws from torch's RNG, but be sure nothing comes after this
            torch.set_rng_state(torch.from_numpy(np.array(arrays[TORCH_RNG])))
            cuda = [torch.from_numpy(np.array(v)) for k, v in sorted(arrays.items()) if k.startswith(CUDA_RNG)]
            if cuda and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(cuda)
            st.rng.bit_generator.state = s["rng"]["numpy"]
            st.registry.restore(s["registry"])
            res = s["results"]
            for t, d, n in res["bytes"]:
                st.counters.bytes[(t, d)] = n
            for t, d, n in res["messages"]:
                st.counters.messages[(t, d)] = n
            st.tally.rejected.update(res["rejected"])
            st.tally.handling_s.update(res["handling_s"])
            st.tally.late_updates = res["late_updates"]
            st.tally.late_side_channel = res["late_side_channel"]
            # a checkpoint written before accuracy_clients existed: unknown for its finished tasks
            st.client_accuracy = res.get("client_accuracy", [None] * len(res["matrix"]))
            st.global_round = s["global_round"]
            st.task = min(s["next"]["task"], st.scenario.num_tasks - 1)
            self.clock.restore(s)  # crash downtimes in flight are not kept (docs/resume.md)
            self.resumes = s["resumes"] + 1
            self.stats = {"saved": s["checkpoints"]["saved"], "seconds": s["checkpoints"]["seconds"],
                          "bytes": s["checkpoints"]["bytes"]}
            return Resumed(task=s["next"]["task"], task_round=s["next"]["task_round"], matrix=res["matrix"],
                           rounds=[RoundRecord(**r) for r in res["rounds"]], wall_clock_s=s["wall_clock_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise checkpoint.CheckpointError(f"corrupt checkpoint: cannot restore it ({type(exc).__name__}: "
                                             f"{exc})") from None

    def wait_for_rejoin(self, serve: Serve, own_nodes: bool = False) -> list[str]:
        """After a resume: serve until the clients online at the checkpoint have joined again (their DEALERs
        reconnect on their own; any message of theirs is answered ``not_joined``), at most ``join_timeout_s``.

        ``own_nodes``: this process started every edge node again (``up --resume``): it waits for every client
        whose node has not exited, as a fresh run waits for everyone, however slowly the nodes start (containers
        on busy hosts may come up more than a liveness timeout apart). Otherwise (nodes started elsewhere, by
        hand) it stops early once none has come back for ``liveness_timeout_s`` after the first did (clients
        away for now). Returns the clients that did not come back; they count as dropped."""
        st = self.state
        net, registry, rounds = st.config.network, st.registry, st.config.rounds
        seen = {"awaiting": registry.awaiting_rejoin, "changed": None}

        def settled() -> bool:
            awaiting, now = registry.awaiting_rejoin, time.monotonic()
            if own_nodes:
                return awaiting == 0
            if awaiting != seen["awaiting"]:
                seen.update(awaiting=awaiting, changed=now)
            return awaiting == 0 or (seen["changed"] is not None and now - seen["changed"] > net.liveness_timeout_s)

        serve(settled, time.monotonic() + net.join_timeout_s)
        missing = registry.drop_resumed()
        for _ in missing:
            st.metrics.client_dropped("heartbeat_timeout")
        online = len(registry.eligible(st.task))
        if online < rounds.min_participants:
            raise RunAborted(f"only {online} clients joined the resumed coordinator within "
                             f"{net.join_timeout_s:.0f} s; at least {rounds.min_participants} are needed")
        st.progress("ready", {"online": len(registry.online()), "expected": st.config.scenario.num_clients})
        return missing

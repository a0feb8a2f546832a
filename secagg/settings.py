"""The user-facing SecAgg+ settings (:class:`SecAggSettings`), each declared once with its default and bounds.

A run's configuration embeds them (``secagg:`` in its YAML; the ``--secagg*`` flags take their help and
bounds from these fields), the coordinator hands them to :class:`fcl_emu.secagg.server.SecAggServer`, and
:meth:`SecAggSettings.resolve` turns them into the :class:`fcl_emu.secagg.protocol.RoundParams` of one round.
"""

from __future__ import annotations

import math

import pydantic

from fcl_emu.secagg.noise import DistributedNoise
from fcl_emu.secagg.protocol import (MAX_RING_BITS, MIN_RING_BITS, MIN_THRESHOLD, PHASES, RoundParams, SecAggAbort,
                             default_threshold)

DEFAULT_MAX_WEIGHT = 1 << 16  # the weight clip where neither the settings nor the caller give one


def log_neighbors(n: int) -> int:
    """A logarithmic degree: 2 * ceil(log2 n), at least 4 (even), at most n - 1."""
    return min(n - 1, max(4, 2 * math.ceil(math.log2(max(n, 2)))))


class SecAggSettings(pydantic.BaseModel):
    """Secure aggregation of the model deltas, SecAgg+ (docs/secagg.md). ``enabled`` and ``phase_timeout_s``
    are the run's (the coordinator's), ``model_check`` the edge nodes' (their launcher passes it); the others shape
    every round's :class:`RoundParams`."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    enabled: bool = pydantic.Field(
        False, description="sum the clients' model deltas under SecAgg+ masks: the coordinator sees only the sum "
                           "(docs/secagg.md)")
    neighbors: int | None = pydantic.Field(
        None, ge=MIN_THRESHOLD,
        description="neighbours per client k, the degree of the neighbour graph (unset: 2*ceil(log2 n), at least "
                    "4); capped at n - 1 for n sampled clients, the complete graph (SecAgg)")
    threshold: int | None = pydantic.Field(
        None, ge=MIN_THRESHOLD,
        description="Shamir threshold t: shares that rebuild a secret, also the fewest clients any phase may "
                    "keep; at most k (unset: floor(k/2)+1)")
    clip: float = pydantic.Field(
        1.0, gt=0, description="delta values are clipped to [-clip, clip] before quantisation")
    ring_bits: int = pydantic.Field(
        MAX_RING_BITS, ge=MIN_RING_BITS, le=MAX_RING_BITS, description="the masked sum lives in the ring Z_2^bits")
    max_weight: int | None = pydantic.Field(
        None, ge=1, description=f"sample weights are clipped to this (unset: in a run, the largest client dataset "
                                f"of the task, which the emulated server knows from the scenario; else "
                                f"{DEFAULT_MAX_WEIGHT})")
    model_check: bool = pydantic.Field(
        True, description="a client releases its shares only when every survivor signed the model it trained itself, "
                          "so a coordinator that sends different clients different models aborts the round instead "
                          "of reading one client's update from the sum (needs the run's keys; off: research only, "
                          "docs/secagg.md)")
    phase_timeout_s: float = pydantic.Field(
        30.0, gt=0, description="how long the key, share and unmasking phases wait for replies, in the run "
                                "clock's seconds (the masked input waits until the round deadline)")

    @pydantic.model_validator(mode="after")
    def _threshold(self) -> "SecAggSettings":
        if self.neighbors is not None and self.threshold is not None and self.threshold > self.neighbors:
            raise ValueError(f"secagg.threshold ({self.threshold}) exceeds secagg.neighbors ({self.neighbors})")
        return self

    def neighbors_for(self, n: int) -> int:
        """k for ``n`` sampled clients: the setting capped at n - 1, or :func:`log_neighbors` when unset."""
        return log_neighbors(n) if self.neighbors is None else min(self.neighbors, n - 1)

    def threshold_for(self, k: int) -> int:
        """t for degree ``k``: the setting, or :func:`fcl_emu.secagg.protocol.default_threshold` when unset."""
        return default_threshold(k) if self.threshold is None else self.threshold

    def resolve(self, n: int, dim: int, round_id: int, max_weight: int | None = None,
                noise: DistributedNoise | None = None) -> RoundParams:
        """The parameters of one round of ``n`` sampled clients with ``dim`` values each; ``max_weight`` is the
        weight clip where the settings leave it unset (default :data:`DEFAULT_MAX_WEIGHT`); ``noise``: the
        distributed DP noise every client adds (:mod:`fcl_emu.secagg.noise`; ``clip`` is then the L2 clip). Raises
        :class:`SecAggAbort` when the round cannot run (fewer than 3 clients, t above the possible k)."""
        if n < 3:
            raise SecAggAbort(f"{n} clients sampled: secure aggregation needs at least 3", PHASES[0])
        k = self.neighbors_for(n)
        t = self.threshold_for(k)
        if t > k >= MIN_THRESHOLD:
            raise SecAggAbort(f"threshold t={t} exceeds the degree k={k} possible with {n} sampled clients",
                              PHASES[0])
        return RoundParams(round_id=round_id, n=n, dim=dim, neighbors=k, threshold=t, ring_bits=self.ring_bits,
                           clip=self.clip, max_weight=self.max_weight or max_weight or DEFAULT_MAX_WEIGHT,
                           noise=noise)

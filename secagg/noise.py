"""Distributed differential privacy under SecAgg+: each client's L2 clipping and its share of the noise, added
in the ring so that it survives the modular sum (docs/secagg.md, "Distributed differential privacy").

The mechanism is the Skellam mechanism of Agarwal, Kairouz and Liu 2021 ("The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021), the integer counterpart of the distributed discrete
Gaussian of Kairouz, Liu and Steinke 2021 ("The Distributed Discrete Gaussian Mechanism for Federated Learning
with Secure Aggregation", ICML 2021). With C the L2 clip norm, z the noise multiplier, K the planned cohort
(``rounds.clients_per_round``), M the levels per client and D the vector length:

1. the client clips its vector to L2 norm C and quantises it with the protocol's fixed-point encoding (one level
   is 2C/M, stochastic rounding; :class:`fcl_emu.secagg.protocol.Quantizer`);
2. it adds to each of its D values an independent Skellam variable Sk(mu, mu) = Poisson(mu) - Poisson(mu)
   (numpy's Poisson sampler, from the OS's entropy: nobody else can repeat it), of variance
   2 mu = z^2 Delta^2 / K, where Delta = M/2 + sqrt(D) is the L2 sensitivity of one client's quantised vector
   (C in levels is M/2; stochastic rounding moves each value by less than one level);
3. sums of independent Skellam variables are Skellam: the m clients in the masked sum add Sk(m mu, m mu), of
   variance (m/K) z^2 Delta^2, which at m = K is the central mechanism's z^2 Delta^2 (in levels).

The ring must hold the clipped sum plus the noise without wrapping: the centred sum of n clients lies in
[-n M/2, n M/2], and Bernstein's inequality bounds the noise of n shares (variance sigma^2) by
sqrt(2L) sigma + 2L/3 except with probability 2 D exp(-L) = :data:`FAILURE_PROBABILITY` over all D values.
:meth:`DistributedNoise.levels` is the largest M for which the two fit in half the ring, and for which each
client's Poisson mean stays at most :data:`MAX_POISSON_MEAN`; the server decodes the sum centred
(:func:`centred_sum`), so a negative noised sum is read back as negative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FAILURE_PROBABILITY = 2.0 ** -40  # chance that some value of the noised sum wraps around the ring
# numpy's Poisson sampler (PTRS, in float64) drifts from the Poisson's variance for large means (measured with
# numpy 2.4 over 400,000 draws: variance / mean 1.002 at 1e12, 1.008 at 1e14, 1.18 at 6e14): a client's mean
# stays at most 2^40 (about 1.1e12), which caps the levels M (still millions for z around 1).
MAX_POISSON_MEAN = 2.0 ** 40
# The most that stochastic rounding may add to the sensitivity (sqrt(D) against C = M/2 levels): a ring whose
# levels leave more is too small for the vector.
MAX_ROUNDING_SHARE = 0.01


@dataclass(frozen=True)
class DistributedNoise:
    """The noise every client of a round adds: multiplier z for a planned cohort of K clients."""

    multiplier: float
    cohort: int

    def __post_init__(self) -> None:
        if not (isinstance(self.multiplier, (int, float)) and math.isfinite(self.multiplier)
                and self.multiplier >= 0):
            raise ValueError(f"the noise multiplier must be a finite number >= 0, got {self.multiplier!r}")
        if isinstance(self.cohort, bool) or not isinstance(self.cohort, int) or self.cohort < 1:
            raise ValueError(f"the noise cohort must be an integer >= 1, got {self.cohort!r}")

    def sensitivity(self, levels: int, dim: int) -> float:
        """Delta: one client's quantised vector's L2 norm around the centre, at most, in levels."""
        return levels / 2 + math.sqrt(dim)

    def share_variance(self, levels: int, dim: int) -> float:
        """Variance of one client's noise on each value, in levels: z^2 Delta^2 / K."""
        return (self.multiplier * self.sensitivity(levels, dim)) ** 2 / self.cohort

    def effective_multiplier(self, survivors: int) -> float:
        """z of the noise that ``survivors`` clients' shares add up to: z sqrt(m / K)."""
        return self.multiplier * math.sqrt(survivors / self.cohort)

    def levels(self, ring_bits: int, n: int, dim: int) -> int:
        """The largest M for which n clients' centred values plus their noise fit in the signed half of the
        ring with probability 1 - :data:`FAILURE_PROBABILITY` (below 1: the ring is too small), and each
        client's Poisson mean z^2 Delta^2 / 2K is at most :data:`MAX_POISSON_MEAN`."""
        bound = 2 ** (ring_bits - 1) - 1
        log_term = math.log(2 * dim / FAILURE_PROBABILITY)
        spread = math.sqrt(2 * log_term) * self.multiplier * math.sqrt(n / self.cohort)  # noise tail / Delta
        # n M/2 + spread (M/2 + sqrt(D)) + 2L/3 <= bound
        levels = math.floor((bound - spread * math.sqrt(dim) - 2 * log_term / 3) / ((n + spread) / 2))
        if self.multiplier > 0:  # Delta = M/2 + sqrt(D) <= sqrt(2 K mu_max) / z
            delta = math.sqrt(2 * self.cohort * MAX_POISSON_MEAN) / self.multiplier
            levels = min(levels, math.floor(2 * (delta - math.sqrt(dim))))
        return levels

    def fits(self, ring_bits: int, n: int, dim: int) -> bool:
        """Whether the ring holds n clients' clipped values plus the noise, with levels fine enough that the
        rounding adds at most :data:`MAX_ROUNDING_SHARE` to the sensitivity."""
        levels = self.levels(ring_bits, n, dim)
        return levels >= 2 and math.sqrt(dim) <= MAX_ROUNDING_SHARE * levels / 2

    def to_dict(self) -> dict[str, Any]:
        return {"multiplier": float(self.multiplier), "cohort": int(self.cohort)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DistributedNoise:
        return cls(multiplier=d["multiplier"], cohort=d["cohort"])


def clip_l2(x: np.ndarray, clip: float) -> np.ndarray:
    """``x`` scaled down to L2 norm ``clip`` if longer (float64, a copy)."""
    x = np.asarray(x, np.float64).copy()
    norm = float(np.linalg.norm(x))
    if norm > clip:
        x *= clip / norm
    return x


def add_skellam(values: np.ndarray, mu: float, rng: np.random.Generator) -> None:
    """Add Sk(mu, mu) = Poisson(mu) - Poisson(mu) to each uint32 value in place, modulo 2^32."""
    if mu <= 0:
        return
    noise = rng.poisson(mu, values.size) - rng.poisson(mu, values.size)
    np.add(values, (noise & 0xFFFFFFFF).astype(np.uint32), out=values)


def centred_sum(ring_values: np.ndarray, count: int, levels: int, ring_bits: int) -> np.ndarray:
    """sum_i (q_i - M/2) + noise as float64, from the ring sum of ``count`` clients' values: the ring sum less
    count M/2, read as a signed ``ring_bits``-bit integer."""
    offset = count * levels // 2
    centred = (ring_values.astype(np.int64) - offset) & (2 ** ring_bits - 1)
    centred[centred >= 2 ** (ring_bits - 1)] -= 2 ** ring_bits
    return centred.astype(np.float64) - (count * levels / 2 - offset)

"""Differential privacy of the aggregate: central DP-FedAvg with fixed or adaptive clipping, distributed DP under
SecAgg+, and their accountant (``privacy`` in the run config; docs/privacy.md).

**DP-FedAvg** (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models", Algorithm 1
with its fixed-denominator estimator): the coordinator clips each client's model delta to L2 norm C,

    clip(D_k) = D_k * min(1, C / ||D_k||),

averages the clipped deltas with equal weights over the fixed cohort size K = ``rounds.clients_per_round``
(the sample counts the clients report are not used, and the denominator does not depend on who arrived, so
adding or removing one client moves the mean by at most C / K), and adds Gaussian noise to the mean:

    mean = sum_k clip(D_k) / K + N(0, (z C / K)^2 I).

The method's server part receives that noised mean as its round's only update, so its sample-weighted FedAvg
of one update is the update itself; integer buffers (BatchNorm's step counter) are not released, and the
server keeps its own value of them, as under secure aggregation.

**Adaptive clipping** (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping",
Algorithm 1 and Theorem 1): C follows the ``target_quantile`` gamma of the update norms. Each round, with
b_k = 1[||D_k|| <= C] and the count's noise sigma_b (default K / 20, the paper's recommendation),

    b = (sum_k b_k + N(0, sigma_b^2)) / K,        C <- C * exp(-eta_C (b - gamma)),

and the delta's noise multiplier is z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2), so that the two Gaussian releases
together cost what one with multiplier z costs. The round is clipped with C, then C is updated.

**Accounting**: each noised round is the sampled Gaussian mechanism with multiplier z, composed over the noised
rounds by the Renyi-DP accountant of Google's dp-accounting library (``dp_accounting.rdp.RdpAccountant``), twice
(:class:`PrivacyAccountant`):

- *as sampled* (``epsilon_sampled``, the figure that holds): each round as the emulator drew it, a cohort of fixed
  size (the clients it selected) without replacement from that round's eligible online clients
  (``SampledWithoutReplacementDpEvent``, under the replace-one neighbouring relation that dp-accounting's analysis
  of this sampling takes, Wang, Balle and Kasiviswanathan 2019); under churn, availability or clients joining task
  by task the pool is smaller than the population and each round costs more;
- *as assumed* (``epsilon``): Poisson sampling at q = ceil(K x overcommit) / num_clients over every client, under
  add-or-remove, as the McMahan and Andrew analyses write it; the figure those papers would report, kept beside the
  other for comparison.

Epsilon for ``privacy.delta`` is reported after every round, both ways.

**Distributed DP** (``privacy.mode: distributed``, under SecAgg+; :mod:`fcl_emu.secagg.noise`): the clients clip their
own deltas to C and each adds integer Skellam noise of variance z^2 Delta^2 / K in the quantised domain, so the
masked sum of the K planned clients carries the central mechanism's noise, in levels; the coordinator divides
the unmasked sum by K. The accountant is the same with the same z. With m < K clients in the sum (dropouts) the
noise's multiplier is only z sqrt(m / K), and the round is composed with that smaller multiplier: the epsilon
reported covers the noise actually added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fcl_emu.aggregation.update import ClientUpdate, DeltaLayout
from fcl_emu.monitoring.results import Privacy, RoundRecord
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.config import PrivacyConfig
from fcl_emu.secagg.noise import DistributedNoise
from fcl_emu.secagg.settings import SecAggSettings

NOISED_UPDATE = "central-dp"  # the client name of the one update the server part receives


def delta_noise_multiplier(z: float, count_stddev: float) -> float:
    """z_D of Andrew et al. 2021 (Theorem 1): what is left of z for the delta once the clipped count takes its
    share, (z^-2 - (2 sigma_b)^-2)^(-1/2); 0 when z is 0."""
    if z == 0:
        return 0.0
    return (z ** -2 - (2 * count_stddev) ** -2) ** -0.5


def round_noise_multiplier(settings: PrivacyConfig, cohort: int) -> float:
    """The multiplier of the noise on a round's delta for a cohort of K = ``cohort``: z_D with adaptive clipping
    (:func:`delta_noise_multiplier`), else z (distributed DP's noise too, in the ring)."""
    z, adaptive = settings.noise_multiplier, settings.adaptive
    if settings.central and adaptive.enabled and z:
        return delta_noise_multiplier(z, adaptive.count_noise(cohort))
    return z


def noise_to_update(settings: PrivacyConfig, cohort: int, dim: int) -> float:
    """How many times the noise on a round's mean outweighs the mean itself at most: the noise's expected norm,
    sigma sqrt(d) with sigma = z_D C / K on each of the model's d values, over C, the largest norm of a mean of K
    deltas clipped to C; so z_D sqrt(d) / K. Distributed DP's noise is the same up to its rounding (at most 1 %,
    :mod:`fcl_emu.secagg.noise`)."""
    return round_noise_multiplier(settings, cohort) * math.sqrt(dim) / cohort


def cohort_for_noise(settings: PrivacyConfig, dim: int) -> int:
    """The smallest cohort K at which :func:`noise_to_update` is at most 1."""
    cohort = max(1, math.ceil(settings.noise_multiplier * math.sqrt(dim)))
    while noise_to_update(settings, cohort, dim) > 1:  # adaptive clipping's z_D falls towards z as K grows
        cohort += 1
    return cohort


Sample = tuple[int, int]  # a round's sampling as it happened: (clients selected, eligible clients drawn from)


class PrivacyAccountant:
    """Epsilon of the sampled Gaussian mechanism composed over rounds (dp-accounting's RDP accountant), as each
    round sampled and as Poisson sampling at the run's rate would have (the module docstring)."""

    def __init__(self, noise_multiplier: float, sampling_rate: float, orders: Sequence[float] | None = None):
        import dp_accounting
        from dp_accounting import rdp

        self._dp = dp_accounting
        orders = rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS if orders is None else list(orders)
        self._assumed = rdp.RdpAccountant(orders)
        self._sampled = rdp.RdpAccountant(orders, dp_accounting.NeighboringRelation.REPLACE_ONE)
        self.noise_multiplier, self.sampling_rate, self.steps = noise_multiplier, sampling_rate, 0
        self._noiseless = noise_multiplier == 0  # a round composed without noise: no guarantee
        self._unsampled = 0  # rounds composed without their sampling (a resumed run's records from before it)

    def step(self, count: int = 1, noise_multiplier: float | None = None, sample: Sample | None = None) -> None:
        """Compose ``count`` more rounds (with ``noise_multiplier`` instead of the run's, where given), each
        drawn as ``sample`` says (None: not known, and there is no figure as sampled)."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        self._noiseless |= z == 0
        if z > 0:
            gaussian = self._dp.GaussianDpEvent(z)
            self._assumed.compose(self._dp.PoissonSampledDpEvent(self.sampling_rate, gaussian), count)
            if sample is not None:
                selected, pool = sample
                self._sampled.compose(self._dp.SampledWithoutReplacementDpEvent(pool, selected, gaussian), count)
        self._unsampled += count if sample is None else 0
        self.steps += count

    def replay(self, rounds: Sequence[RoundRecord]) -> None:
        """Compose again the noised rounds of a resumed run from its records: each with the multiplier and the
        sampling its record names."""
        steps = 0
        for r in rounds:
            report = r.privacy
            if report is not None and report["steps"] > steps:
                sample = None if r.eligible is None else (r.selected, r.eligible)
                self.step(report["steps"] - steps, report.get("noise_multiplier"), sample)
                steps = report["steps"]

    def epsilon(self, delta: float) -> float | None:
        """Epsilon for ``delta`` after the rounds composed so far, as Poisson sampling at the run's rate would
        have spent it (None without noise: no guarantee)."""
        if self._noiseless:
            return None
        return float(self._assumed.get_epsilon(delta)) if self.steps else 0.0

    def epsilon_sampled(self, delta: float) -> float | None:
        """Epsilon for ``delta`` after the rounds composed so far, as they sampled (None without noise, or where a
        round's sampling is not known)."""
        if self._noiseless or self._unsampled:
            return None
        return float(self._sampled.get_epsilon(delta)) if self.steps else 0.0

    def report(self, delta: float) -> dict[str, float | int | None]:
        return {"epsilon": self.epsilon(delta), "epsilon_sampled": self.epsilon_sampled(delta), "delta": delta,
                "steps": self.steps}


class CentralPrivacy:
    """The run's central DP: the noised mean of each round and the privacy spent so far."""

    def __init__(self, settings: PrivacyConfig, cohort: int, sampling_rate: float):
        self.settings, self.cohort = settings, cohort
        adaptive = settings.adaptive
        self.count_stddev = adaptive.count_noise(cohort) if adaptive.enabled and settings.noise_multiplier else 0.0
        self.delta_multiplier = round_noise_multiplier(settings, cohort)
        self.clip = settings.clip  # the norm the next round clips to
        self.last_clip = settings.clip  # the norm the last noised round clipped to
        self.accountant = PrivacyAccountant(settings.noise_multiplier, sampling_rate)

    @classmethod
    def of(cls, config: RunConfig) -> CentralPrivacy | None:
        """The run's central DP, or None with ``privacy.mode: off``."""
        if not config.privacy.central:
            return None
        return cls(config.privacy, config.rounds.clients_per_round, sampling_rate(config))

    def noise_std(self, clip: float) -> float:
        """Standard deviation of the noise on each coordinate of the mean of deltas clipped to ``clip``:
        z_D C / K."""
        return self.delta_multiplier * clip / self.cohort

    def noised_mean(self, updates: list[ClientUpdate], layout: DeltaLayout, round_number: int,
                    sample: Sample | None = None) -> ClientUpdate:
        """The clipped, equally weighted, noised mean of the updates' float model deltas (the module docstring),
        as one update; composes the round (drawn as ``sample`` says) into the accountant and, with adaptive
        clipping, moves the clip norm."""
        rng = self._rng(round_number)
        total, unclipped = np.zeros(layout.dim, np.float64), 0
        for update in updates:
            flat = layout.flatten(update.tensors).astype(np.float64)
            norm = float(np.linalg.norm(flat))
            unclipped += norm <= self.clip
            total += flat if norm <= self.clip else flat * (self.clip / norm)
        mean = total / self.cohort + rng.normal(0.0, self.noise_std(self.clip), layout.dim)
        self.last_clip = self.clip
        adaptive = self.settings.adaptive
        if adaptive.enabled:
            self.clip = adaptive_clip(self.clip, unclipped + rng.normal(0.0, self.count_stddev), self.cohort,
                                      adaptive.target_quantile, adaptive.learning_rate)
        self.accountant.step(sample=sample)
        return ClientUpdate(NOISED_UPDATE, 1, layout.unflatten(mean))

    def release(self, updates: list[ClientUpdate], layout: DeltaLayout, round_number: int,
                sample: Sample | None = None) -> list[ClientUpdate]:
        """What the method's server part aggregates: the noised mean, as one update."""
        return [self.noised_mean(updates, layout, round_number, sample)]

    def report(self) -> dict[str, float | int | None]:
        """The round record's ``privacy``: epsilon for delta so far (as assumed and as sampled), noised rounds,
        the clip norm the last one used and the noise's standard deviation on its mean, the clip norm of the
        next."""
        return {**self.accountant.report(self.settings.delta), "clip": self.last_clip,
                "noise_std": self.noise_std(self.last_clip), "next_clip": self.clip}

    def restore(self, rounds: Sequence[RoundRecord]) -> None:
        """Take over the state of a resumed run from its round records: the rounds composed, the clip norm."""
        self.accountant.replay(rounds)
        reports = [r.privacy for r in rounds if r.privacy is not None]
        if reports:
            self.last_clip, self.clip = reports[-1]["clip"], reports[-1]["next_clip"]

    def _rng(self, round_number: int) -> np.random.Generator:
        seed = self.settings.noise_seed
        return np.random.default_rng() if seed is None else np.random.default_rng([seed, round_number])


class DistributedPrivacy:
    """The run's distributed DP under SecAgg+: the noise its clients add to each round's masked sum, and the
    privacy spent so far (the module docstring)."""

    def __init__(self, settings: PrivacyConfig, cohort: int, sampling_rate: float):
        self.settings, self.cohort, self.clip = settings, cohort, settings.clip
        self.noise = DistributedNoise(settings.noise_multiplier, cohort)
        self.last_multiplier = settings.noise_multiplier  # of the last round's summed noise
        self.accountant = PrivacyAccountant(settings.noise_multiplier, sampling_rate)

    @classmethod
    def of(cls, config: RunConfig) -> DistributedPrivacy | None:
        """The run's distributed DP, or None unless ``privacy.mode: distributed``."""
        if not config.privacy.distributed:
            return None
        return cls(config.privacy, config.rounds.clients_per_round, sampling_rate(config))

    def secagg_settings(self, settings: SecAggSettings) -> SecAggSettings:
        """The run's SecAgg+ settings as distributed DP runs them: values clipped to the L2 clip norm C (which
        bounds every value too), every client weighing 1."""
        return settings.model_copy(update={"clip": self.clip, "max_weight": 1})

    def release(self, updates: list[ClientUpdate], layout: DeltaLayout, round_number: int,
                sample: Sample | None = None) -> list[ClientUpdate]:
        """The unmasked mean already holds the noise (one update, its weight the clients in the sum): compose the
        round (drawn as ``sample`` says) with the multiplier of the noise those clients added. A client without
        samples adds its noise but weighs 0: leaving it out of the count only lowers the multiplier accounted,
        which is conservative."""
        summed = sum(u.num_samples for u in updates)
        self.last_multiplier = self.noise.effective_multiplier(min(summed, self.cohort))
        self.accountant.step(noise_multiplier=self.last_multiplier, sample=sample)
        return updates

    def report(self) -> dict[str, float | int | None]:
        """The round record's ``privacy``, as central DP's; ``noise_multiplier``: of the last round's noise."""
        return {**self.accountant.report(self.settings.delta), "clip": self.clip,
                "noise_std": self.last_multiplier * self.clip / self.cohort, "next_clip": self.clip,
                "noise_multiplier": self.last_multiplier}

    def restore(self, rounds: Sequence[RoundRecord]) -> None:
        """Compose again the rounds of a resumed run, each with the multiplier and sampling its record names."""
        self.accountant.replay(rounds)


def run_privacy_part(config: RunConfig) -> CentralPrivacy | DistributedPrivacy | None:
    """The run's differential privacy, central or distributed (None with ``privacy.mode: off``)."""
    return CentralPrivacy.of(config) or DistributedPrivacy.of(config)


def sampling_rate(config: RunConfig) -> float:
    """q: the clients a round selects over the clients of the scenario."""
    rounds = config.rounds
    return min(1.0, rounds.planned_cohort / config.scenario.num_clients)


def run_privacy(config: RunConfig, rounds: Sequence[RoundRecord]) -> Privacy | None:
    """``summary.json``'s ``privacy``: the settings and the last round's report (None without differential
    privacy)."""
    s = config.privacy
    if s.mode == "off":
        return None
    last = next((r.privacy for r in reversed(rounds) if r.privacy is not None), None)
    return Privacy(mode=s.mode, noise_multiplier=s.noise_multiplier, clip=s.clip if last is None else last["clip"],
                   adaptive=s.adaptive.enabled, sampling_rate=sampling_rate(config),
                   steps=0 if last is None else last["steps"], delta=s.delta,
                   epsilon=(0.0 if s.noise_multiplier else None) if last is None else last["epsilon"],
                   epsilon_sampled=(0.0 if s.noise_multiplier else None) if last is None
                   else last.get("epsilon_sampled"))


def adaptive_clip(clip: float, noised_unclipped: float, cohort: int, target_quantile: float,
                  learning_rate: float) -> float:
    """Andrew et al. 2021's geometric update: C * exp(-eta_C (b - gamma)) with b the noised fraction of
    unclipped updates."""
    return clip * math.exp(-learning_rate * (noised_unclipped / cohort - target_quantile))

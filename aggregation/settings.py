"""Every setting of aggregation, declared once: the round policy (:class:`AggregationSettings`, the run config's
``aggregation:``) and the clipping and rule that turn a round's updates into one delta
(:class:`AggregationDefences`, part of the run config's ``security:``)."""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from fcl_emu.aggregation.policies import POLICY_NAMES, RoundPolicy, make_policy
from fcl_emu.aggregation.rules import Aggregator, RuleName
from fcl_emu.aggregation.rules.base import RuleParams
from fcl_emu.aggregation.server_optimizers import OPTIMIZER_NAMES, ServerOptimizer, make_optimizer, optimizer_options

PolicyName = Literal[POLICY_NAMES]  # type: ignore[valid-type]
OptimizerName = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
SERVER_OPTIONS = ("lr", "momentum", "beta1", "beta2", "tau")  # server_<name>: an option of the server optimiser


class AggregationSettings(pydantic.BaseModel):
    """The round policy (:mod:`fcl_emu.aggregation.policies`) and its parameters."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    kind: PolicyName = pydantic.Field(
        "sync", description="sync (rounds), fedbuff (buffered asynchronous aggregation) or fedasync (each update "
                            "mixed in on arrival); the asynchronous ones run on the emulated clock")
    buffer: int = pydantic.Field(
        10, ge=1, description="fedbuff: the server aggregates every B arrived updates (10, as in the FedBuff paper)")
    max_staleness: int = pydantic.Field(
        4, ge=0, description="asynchronous: updates staler than S server versions are discarded (4: the bound of "
                             "FedAsync's experiments)")
    concurrency: int | None = pydantic.Field(
        None, ge=1, description="asynchronous: clients kept training at once (unset: clients_per_round)")
    async_alpha: float = pydantic.Field(
        0.6, gt=0, le=1, description="fedasync: the mixing weight alpha of x <- (1 - a_t) x + a_t x_new")
    async_staleness_exponent: float = pydantic.Field(
        0.5, ge=0, description="fedasync: a of the polynomial staleness function s(t) = (1 + t)^-a, "
                               "a_t = alpha * s(t)")
    server_optimizer: OptimizerName = pydantic.Field(
        "none", description="the server step on each synchronous round's aggregate (docs/aggregation.md): none "
                            "(FedAvg), fedavgm (server momentum, Hsu et al. 2019), fedadam, fedyogi or fedadagrad "
                            "(Reddi et al. 2021)")
    server_lr: float | None = pydantic.Field(
        None, description="the server optimiser's learning rate eta (unset: its default, 0.1 for fedavgm, 0.01 "
                          "for the adaptive ones)")
    server_momentum: float | None = pydantic.Field(None, description="fedavgm: the server momentum (unset: 0.9)")
    server_beta1: float | None = pydantic.Field(
        None, description="fedadam, fedyogi, fedadagrad: the first moment's decay (unset: 0.9)")
    server_beta2: float | None = pydantic.Field(
        None, description="fedadam, fedyogi: the second moment's decay (unset: 0.99)")
    server_tau: float | None = pydantic.Field(
        None, description="fedadam, fedyogi, fedadagrad: the adaptivity tau (unset: 1e-3)")

    @pydantic.model_validator(mode="after")
    def _server_options(self) -> AggregationSettings:
        """The server optimiser's options are its own (:mod:`fcl_emu.aggregation.server_optimizers`): one it does
        not take, or a value out of its range, is refused here."""
        optimizer_options(self.server_optimizer, self.server_option_values())
        return self

    def server_option_values(self) -> dict[str, float]:
        """The set ``server_*`` values, by the optimiser's option names."""
        values = {name: getattr(self, f"server_{name}") for name in SERVER_OPTIONS}
        return {name: value for name, value in values.items() if value is not None}

    def server_step(self) -> ServerOptimizer | None:
        """The run's server optimiser (None: the plain FedAvg step)."""
        return make_optimizer(self.server_optimizer, self.server_option_values())

    def policy(self) -> RoundPolicy:
        return make_policy(self)

    @property
    def asynchronous(self) -> bool:
        return self.policy().asynchronous

    def resolved_concurrency(self, clients_per_round: int) -> int:
        return self.concurrency if self.concurrency is not None else clients_per_round


class AggregationDefences(pydantic.BaseModel):
    """How a round's plain updates are bounded and combined (docs/security.md, "Aggregation defences"): clipping
    (:mod:`fcl_emu.aggregation.clipping`) and the rule (:mod:`fcl_emu.aggregation.rules`)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    clip_norm: float | None = pydantic.Field(
        None, gt=0, description="robust aggregation: scale every model delta down to at most this L2 norm before "
                                "aggregating (norm clipping)")
    adaptive_clip: float | None = pydantic.Field(
        10.0, ge=1, description="scale every update's delta down to at most this multiple of the median L2 norm of "
                               "its round's updates before aggregating (then each tensor to this multiple of that "
                               "tensor's median norm), and leave out an upload used one by one (a "
                               "FedCBC VAE, a GLFC prototype gradient) beyond it; off: no adaptive bound (plain "
                               "rounds only: a secure round shows no single update)")
    direction_check: float | None = pydantic.Field(
        10.0, gt=0, description="refuse an update that agrees with nothing of its round's cohort: whose largest cosine "
                                "with the mean of a sample of the cohort and with each other update of the sample is "
                                "below Z / sqrt(d) for d weights (Z standard deviations of a random direction's "
                                "cosine; counted as off_cohort); off: no check (plain rounds of 3 updates or more)")
    aggregator: RuleName = pydantic.Field(
        "mean", description="how a round's deltas are combined: mean (FedAvg, weighted by samples), median or "
                            "trimmed_mean (coordinate-wise, Yin et al. 2018), krum or multikrum (Blanchard et al. "
                            "2017), bulyan (El Mhamdi et al. 2018); docs/security.md")
    trim_fraction: float = pydantic.Field(
        0.1, ge=0, lt=0.5, description="the fraction of values trimmed_mean cuts at each end of every coordinate")
    byzantine: int = pydantic.Field(
        1, ge=0, le=1000, description="the hostile updates f a round of krum, multikrum or bulyan must withstand "
                                      "(krum and multikrum need 2f + 3 updates, bulyan 4f + 3; fewer: the round is "
                                      "skipped)")
    multikrum_keep: int | None = pydantic.Field(
        None, ge=1, description="the updates of best Krum score that multikrum averages (unset: n - f)")

    @pydantic.field_validator("adaptive_clip", "direction_check", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        """``off`` (a flag's word, or YAML's false) turns the adaptive bound or the direction check off."""
        return None if value is False or value == "off" else value

    def robust_aggregator(self) -> Aggregator:
        """The aggregation rule with its parameters."""
        return Aggregator(self.aggregator, RuleParams(self.trim_fraction, self.byzantine, self.multikrum_keep))

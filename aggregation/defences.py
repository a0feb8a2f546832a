"""The plain round's defences over one group of updates, in the order the plain round applies them
(docs/security.md, "Aggregation defences"): the fixed norm bound (``--max-update-norm``, refused as
``norm_bound``), the direction check (``--direction-check``, refused as ``off_cohort``), norm clipping
(``--clip-norm``) and the adaptive bound (``--adaptive-clip``). :func:`bound` is what every path that sums updates
without the plain round calls: an edge aggregator's collect and each of its edge rounds, and the asynchronous
policies' buffers (:mod:`fcl_emu.coordinator.async_rounds`), so none of them takes an update the plain round would
refuse or clip."""

from __future__ import annotations

from dataclasses import dataclass

from fcl_emu.aggregation.clipping import clip_to_cohort, clip_update, delta_norm
from fcl_emu.aggregation.direction import off_cohort
from fcl_emu.aggregation.update import DELTA, ClientUpdate

Refused = dict[str, tuple[str, str]]  # client -> (reason, detail)


@dataclass(frozen=True)
class Defences:
    """The defences' settings, each None where it is off (the run config's ``security``, an ``edge_collect``)."""

    max_update_norm: float | None = None
    direction_check: float | None = None
    clip_norm: float | None = None
    adaptive_clip: float | None = None

    @classmethod
    def of(cls, settings) -> Defences:
        """The defences of anything that names them (the run's ``security`` settings, an ``edge_collect``)."""
        return cls(settings.max_update_norm, settings.direction_check, settings.clip_norm, settings.adaptive_clip)


def bound(updates: list[ClientUpdate], defences: Defences, prefixes: tuple[str, ...] = (DELTA,),
          cohort: str = "its round's cohort") -> tuple[list[ClientUpdate], Refused]:
    """``updates`` (with samples) after the defences, in their order: those not refused, each clipped; and the
    refused, each with its reason and a detail naming ``cohort`` (what the direction check compared it with).
    The direction check and the adaptive bound take the group as the cohort, over the tensors under
    ``prefixes`` (the method's summed uploads)."""
    refused: Refused = {}
    if (limit := defences.max_update_norm) is not None:
        for u in updates:
            if not (norm := delta_norm(u)) <= limit:
                refused[u.client] = ("norm_bound", f"{u.client}'s model delta has L2 norm {norm:.4g} > {limit:g}")
    kept = [u for u in updates if u.client not in refused]
    if defences.direction_check is not None:
        for client, agreement in off_cohort(kept, defences.direction_check, prefixes).items():
            refused[client] = ("off_cohort", f"refused {client}'s update: it agrees with nothing of {cohort} "
                                             f"(largest cosine {agreement:.3g}; --direction-check)")
        kept = [u for u in kept if u.client not in refused]
    if defences.clip_norm is not None:
        kept = [clip_update(u, defences.clip_norm) for u in kept]
    if defences.adaptive_clip is not None:
        kept = clip_to_cohort(kept, defences.adaptive_clip, prefixes)
    return kept, refused

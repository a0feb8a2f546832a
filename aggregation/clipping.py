"""Norm bounds on updates before the rule combines them (docs/security.md, "Aggregation defences"): the L2 norm of
an update's deltas (:func:`delta_norm`), clipping to a fixed norm (:func:`clip_update`, ``--clip-norm``) and to a
multiple of the cohort's median norm (:func:`clip_to_cohort`, ``--adaptive-clip``, on by default), and the same
multiple as a limit on uploads a method uses one by one (:func:`beyond_cohort`: side channels, VAEs)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from fcl_emu.aggregation.update import DELTA, ClientUpdate


def delta_norm(update: ClientUpdate, prefix: str = DELTA) -> float:
    """L2 norm of an update's float tensors under ``prefix`` (default: the model delta) taken together: from the
    update's square sums where known (the wire's finite check computes them on receipt, within 1e-7 of a float64
    sum, so a received update is not read again), else summed in float64 on the calling thread (``np.dot`` would
    hand it to the BLAS threads: ten times slower on a busy host)."""
    return math.sqrt(sum(_squares(update, name) for name in update.float_names(prefix)))


def tensor_norm(update: ClientUpdate, name: str) -> float:
    """The L2 norm of one of an update's float tensors, as :func:`delta_norm` takes it."""
    return math.sqrt(_squares(update, name))


def _squares(update: ClientUpdate, name: str) -> float:
    """The sum of the squares of an update's tensor ``name``: its known square sum, else summed here."""
    squares = update.square_sums.get(name)
    return _square_sum(update.tensors[name]) if squares is None else squares


def _square_sum(value: np.ndarray) -> float:
    """The sum of ``value``'s squares in float64 on the calling thread."""
    flat = value.reshape(-1).astype(np.float64, copy=False)
    return float(np.einsum("i,i->", flat, flat))


def clip_update(update: ClientUpdate, max_norm: float, prefix: str = DELTA) -> ClientUpdate:
    """``update`` with its float tensors under ``prefix`` (default: the model delta) scaled down to L2 norm
    ``max_norm`` if larger (norm clipping, as in DP-FedAvg, McMahan et al. 2018, and Sun et al. 2019 against
    backdoors); other tensors unchanged."""
    norm = delta_norm(update, prefix)
    if norm <= max_norm:
        return update
    return update.scaled(max_norm / norm, update.float_names(prefix))


def clip_to_cohort(updates: list[ClientUpdate], multiplier: float, prefixes: tuple[str, ...] = (DELTA,)
                   ) -> list[ClientUpdate]:
    """The round's updates with each one's deltas under every prefix of ``prefixes`` (the method's summed
    uploads) clipped to ``multiplier`` times the median of the cohort's norms under that prefix, then each float
    tensor to ``multiplier`` times the median of the cohort's norms of that tensor: the adaptive norm bound that is
    on by default.

    Norm clipping bounds what one update can move the mean (Sun et al. 2019, "Can You Really Backdoor Federated
    Learning?"); taking the bound from the cohort's median norm (FLAME, Nguyen et al. 2022, clips to the median
    itself) needs no tuning per model and stays honest while fewer than half of the updates are hostile. The bound
    per tensor keeps an update from putting all it may move into one small tensor (a push on one class's output
    bias). An honest update within ``multiplier`` x the medians is left exactly as it was."""
    for prefix in prefixes if updates else ():
        norms = [delta_norm(u, prefix) for u in updates]
        bound = multiplier * float(np.median(norms))
        updates = [clip_update(u, bound, prefix) if norm > bound else u for u, norm in zip(updates, norms)]
    for name in updates[0].float_names(prefixes) if updates else ():
        norms = [tensor_norm(u, name) for u in updates]
        bound = multiplier * float(np.median(norms))
        updates = [u.scaled(bound / norm, [name]) if norm > bound else u for u, norm in zip(updates, norms)]
    return updates


def l2_norm(arrays: Iterable[np.ndarray]) -> float:
    """The L2 norm of ``arrays`` taken together, summed in float64."""
    return math.sqrt(sum(_square_sum(value) for value in arrays))


def beyond_cohort(norms: Sequence[float], multiplier: float, earlier: Sequence[float] = ()) -> list[bool]:
    """Which of a round's uploads lie beyond ``multiplier`` times the median norm of their cohort: these uploads
    and the ``earlier`` ones of the same kind that were accepted (a NaN always lies beyond).

    The adaptive bound of :func:`clip_to_cohort` for uploads a method uses one by one rather than sums (GLFC's
    prototype gradients, FedCBC's VAEs): such an upload scaled back inside the bound would still carry what was
    manipulated (an inverted gradient shows a different image), so it is left out instead. Holds while fewer
    than half of the cohort is hostile; a cohort of one or two cannot tell an outlier and refuses nothing."""
    cohort = [n for n in (*earlier, *norms) if not math.isnan(n)]
    if len(cohort) < 3:
        return [math.isnan(n) for n in norms]
    bound = multiplier * float(np.median(cohort))
    return [not n <= bound for n in norms]

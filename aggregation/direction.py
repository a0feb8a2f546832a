"""A direction check on a round's updates before they are bounded and combined (docs/security.md, "Aggregation
defences"): an update that agrees with nothing its cohort does is refused (:func:`off_cohort`,
``--direction-check``, on by default).

The norm bound (:mod:`fcl_emu.aggregation.clipping`) limits an update's length, not where it points: an honest
delta reversed and scaled within the bound, noise, or a push on one class's output bias keep a length an honest
client could have. An honest update shares a direction with its cohort: its clients start from the same model
and descend losses that overlap, so it correlates positively with the cohort's mean or, where its data differs
from most (a class few clients of the round hold), with the update of another client that holds the same data.
A reversed update correlates negatively with both; noise and a change to a few coordinates correlate with
nothing. Comparing updates with each other or with a reference is the idea of FLTrust (Cao et al. 2021, which
takes the reference from a data set held by the server: the emulator holds none) and of FoolsGold (Fung et al.
2020, which looks for updates that are too alike instead).

The test: the agreement of an update is the largest cosine it has with the mean of a sample of the cohort (without
itself) and with each other update of the sample; it is refused when that is below ``z / sqrt(d)`` for a model
of ``d`` weights (at most :data:`MAX_THRESHOLD`). The cosine of a random direction with a fixed one has a standard
deviation of ``1 / sqrt(d)``, so ``z`` is how many standard deviations of chance an update must agree by (default
10: 0.019 for the MNIST CNN of 282,501 weights; the honest updates of the measured runs of every method agreed by
0.063 or more, docs/results/insider.md).
Refused rather than scaled down, as :func:`~fcl_emu.aggregation.clipping.beyond_cohort` does: a reversed update
scaled down still pushes the wrong way.

What it does not hold: insiders that agree with each other (two sending the same noise vouch for each other), and
an update that mixes an honest part, enough to agree, with a poisoned one; the norm bound still limits both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fcl_emu.aggregation.clipping import delta_norm
from fcl_emu.aggregation.update import DELTA, ClientUpdate

# The updates every other is compared with, at most: evenly spaced in client order. At 1,000 updates a round the
# check then costs one dot product per update plus a 25 x 25 Gram matrix.
SAMPLE_SIZE = 25

# Coordinates of the screen that spares most updates the full comparison: an update outside the sample whose cosine
# with the sample's mean or a member over these coordinates (drawn afresh each round from the OS's entropy, so that
# no client can aim at them) exceeds the threshold by 5 standard deviations of that estimate (5 / sqrt(SKETCH)) is
# accepted; the others are compared in full. At 1,000 updates a round of the MNIST CNN, each with a sample or two,
# comparing in full cost 0.8 s a round, the screened check 0.1 s (docs/results/insider.md).
SKETCH = 4096

# The most agreement asked of an update, whatever Z and however small the model: below 40,000 weights Z = 10 would
# ask more than honest updates of a small model need to show (and above 1 for 100 weights or fewer).
MAX_THRESHOLD = 0.05

# Fewer updates than this and nothing is refused: of two updates that disagree, neither can be told the honest one.
MIN_COHORT = 3


def off_cohort(updates: Sequence[ClientUpdate], z: float, prefixes: tuple[str, ...] = (DELTA,)
               ) -> dict[str, float]:
    """The clients whose update agrees with nothing of its cohort under any of ``prefixes`` (the method's summed
    uploads), each with its agreement (:func:`agreements`, below ``z / sqrt(d)`` or :data:`MAX_THRESHOLD`, whichever
    is smaller); none in a round of fewer than :data:`MIN_COHORT` updates. A zero update (no direction) is never
    refused: it moves nothing."""
    off: dict[str, float] = {}
    for prefix in prefixes if len(updates) >= MIN_COHORT else ():
        size = sum(updates[0].tensors[n].size for n in updates[0].float_names(prefix))
        threshold = min(z / math.sqrt(size), MAX_THRESHOLD)
        for update, agreement in zip(updates, agreements(updates, prefix, threshold)):
            if agreement < threshold:
                off[update.client] = min(agreement, off.get(update.client, agreement))
    return off


def agreements(updates: Sequence[ClientUpdate], prefix: str = DELTA, enough: float = math.inf) -> list[float]:
    """Each update's agreement with its cohort over its float tensors under ``prefix``: the largest cosine with
    the mean of the sample (:class:`Sample`, without the update itself) and with each other update of the sample;
    a member of the sample also takes the cosines of the others that were compared with it (a minority's member
    then counts its peer outside the sample); NaN for a zero update. An update outside the sample whose agreement
    surely reaches ``enough`` on a sketch of :data:`SKETCH` coordinates, or whose cosine with the sample's mean
    reaches it, is not compared with each member in full (its agreement is then that estimate or cosine): the
    shortcuts that keep the check at a small part of the mean's cost at 1,000 updates a round."""
    sample = Sample(updates, prefix)
    result = {i: sample.agreement(u, enough) for i, u in enumerate(updates) if i not in sample.rows}
    for i, row in sample.rows.items():
        result[i] = max(sample.member_agreement(row), sample.vouched[row])
    return [result[i] for i in range(len(updates))]


class Sample:
    """:data:`SAMPLE_SIZE` of a cohort's updates spread evenly over its order, their Gram matrix and sum over the
    float tensors under ``prefix``."""

    def __init__(self, updates: Sequence[ClientUpdate], prefix: str):
        self.prefix = prefix
        self.names = updates[0].float_names(prefix)
        picks = np.unique(np.linspace(0, len(updates) - 1, min(len(updates), SAMPLE_SIZE)).round().astype(int))
        self.members = [updates[i] for i in picks]
        self.rows = {int(i): row for row, i in enumerate(picks)}  # cohort index -> row of the Gram matrix
        self.gram = np.zeros((len(picks), len(picks)))
        self.total: dict[str, np.ndarray] = {}
        for name in self.names:
            stacked = np.stack([u.tensors[name].reshape(-1) for u in self.members])
            self.gram += (stacked @ stacked.T).astype(np.float64)
            self.total[name] = stacked.sum(axis=0)
        self.norms = np.sqrt(np.diag(self.gram))
        self.vouched = np.full(len(picks), -1.0)  # each member's largest cosine with an update outside the sample
        self.sketch = _draw_sketch({n: self.total[n].size for n in self.names})
        # the sample's sum (row 0) and each member (the other rows) on the sketch's coordinates, each row of norm 1
        rows = np.stack([self._sketched(self.total), *(self._sketched(m.tensors) for m in self.members)])
        self.sketched_rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)

    def member_agreement(self, row: int) -> float:
        """A member's agreement, from the Gram matrix: with the sample's mean without it, and with each other
        member."""
        dots, norm = self.gram[row], self.norms[row]
        if not norm > 0:
            return math.nan
        rest = math.sqrt(max(self.gram.sum() - 2 * dots.sum() + dots[row], 0.0))  # |sum of the others|
        with_rest = [(dots.sum() - dots[row]) / (norm * rest)] if rest > 0 else []
        peers = [dots[j] / (norm * self.norms[j]) for j in range(len(dots)) if j != row and self.norms[j] > 0]
        return max([*with_rest, *peers], default=-1.0)

    def agreement(self, update: ClientUpdate, enough: float) -> float:
        """The agreement of an update outside the sample: its estimate on the sketch if that surely reaches
        ``enough``, else its cosine with the sample's mean if that reaches ``enough``, else the largest of that and
        its cosines with each member (who are then vouched for by them)."""
        norm = delta_norm(update, self.prefix)
        if not norm > 0:
            return math.nan
        if self.sketch and (quick := self._sketched_agreement(update, enough + 5 / math.sqrt(SKETCH))) is not None:
            return quick
        with_mean = self._cosine(update, self.total, norm, math.sqrt(max(self.gram.sum(), 0.0)))
        if with_mean >= enough:
            return with_mean
        peers = np.array([self._cosine(update, m.tensors, norm, n) for m, n in zip(self.members, self.norms)])
        self.vouched = np.fmax(self.vouched, peers)
        return max((c for c in (with_mean, *peers) if not math.isnan(c)), default=-1.0)

    def _sketched(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """``tensors`` on the sketch's coordinates (float64)."""
        return np.concatenate([tensors[n].reshape(-1)[i] for n, i in self.sketch.items()] or [[]]).astype(np.float64)

    def _sketched_agreement(self, update: ClientUpdate, sure: float) -> float | None:
        """The agreement of ``update`` estimated on the sketch's coordinates (its largest cosine there with the
        sample's mean and each member) if that reaches ``sure``, else None; the members it agrees with that
        surely are vouched for."""
        values = self._sketched(update.tensors)
        norm = float(np.linalg.norm(values))
        if not norm > 0:
            return None
        cosines = self.sketched_rows @ values / norm
        peers = cosines[1:]
        self.vouched = np.where(peers >= sure, np.fmax(self.vouched, peers), self.vouched)
        best = float(cosines.max())
        return best if best >= sure else None

    def _cosine(self, update: ClientUpdate, other: Mapping[str, np.ndarray], norm: float, other_norm: float) -> float:
        """The cosine of ``update``'s tensors (of L2 norm ``norm`` > 0) with ``other``'s (NaN if that is zero)."""
        if not other_norm > 0:
            return math.nan
        dot = sum(float(np.vecdot(update.tensors[n].reshape(-1), other[n].reshape(-1))) for n in self.names)
        return dot / (norm * other_norm)


def _draw_sketch(sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """:data:`SKETCH` coordinates drawn uniformly over tensors of ``sizes`` (name -> elements), as indices per
    tensor; none where the tensors hold fewer than 16 times as many (comparing in full is then as cheap)."""
    total = sum(sizes.values())
    if total < 16 * SKETCH:
        return {}
    drawn = np.sort(np.random.default_rng().choice(total, SKETCH, replace=False))
    sketch, start = {}, 0
    for name, size in sizes.items():
        inside = drawn[(drawn >= start) & (drawn < start + size)] - start
        if inside.size:
            sketch[name] = inside
        start += size
    return sketch

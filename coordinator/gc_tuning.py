"""The cyclic garbage collector while the rounds run: what is alive once the population has joined kept out of its
passes (:func:`keep_out_of_collections`), and its defaults back when the run ends (:func:`restore_collections`)."""

from __future__ import annotations

import gc

ROUND_GC_THRESHOLDS = (10_000, 20, 10)  # the cyclic collector's thresholds while the rounds run


def keep_out_of_collections() -> None:
    """Move what is alive once the population has joined and been caught up with (its records, availability and
    battery schedules, the model and the data) out of the cyclic collector's passes, after one full collection so
    that no garbage stays, and collect less often while the rounds run. At 100,000 clients a full collection
    walked millions of such objects: 0.5-0.6 s of the coordinator's round whenever one fell in it, every round or
    two. With those frozen, the default thresholds (700, 10, 10) still ran a young collection every 700 new
    containers (a round's messages make hundreds of thousands) and a full one of everything made since the freeze
    every round or two: about 0.15 s of a round of 1,000 updates, against 0.05 s with
    :data:`ROUND_GC_THRESHOLDS` (2026-11-28, ``gc.callbacks``: no middle or full collection in the round). The
    oldest generation keeps its default ratio, so garbage cycles that lived long are still collected every
    ten middle collections. Objects that die are still freed by their reference counts; the run unfreezes and
    restores the thresholds when it ends (:func:`restore_collections`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*ROUND_GC_THRESHOLDS)


def restore_collections(thresholds: tuple[int, ...]) -> None:
    """What the run kept out of collections is collectable again, under the ``thresholds`` it started with."""
    gc.unfreeze()
    gc.set_threshold(*thresholds)

"""The data-free generators' synthesis budgets as a fraction of their official code's, shared by the synthesis
bench (``python -m fcl_emu.bench.synthesis``) and the generative experiment tables (``experiments/``)."""

from __future__ import annotations

import math

#: For every generative method on a CPU: the generators at half width (their default: 128 channels) and 64 synthetic
#: images per client step (default: 128).
CPU = {"generator_width": 64, "synthetic_batch": 64}


def synthesis_budget(method: str, fraction: float) -> dict:
    """The synthesis budget options of ``method`` at ``fraction`` of its official code's (rounded up): MFCL 100
    generator iterations per task (its paper: 5,000); TARGET 10 rounds (2 of warm-up here) of 10 steps; LANDER 50
    rounds (10 of warm-up) of 40 steps; 256 images per round and the student steps per round stay the code's.
    Another method: no options."""
    if method == "mfcl":
        return {"generator_iterations": max(1, math.ceil(100 * fraction))}
    if method == "target":
        rounds = max(2, math.ceil(10 * fraction))
        return {"synthesis_rounds": rounds, "warmup": min(rounds - 1, max(1, math.ceil(2 * fraction)))}
    if method == "lander":
        rounds = max(2, math.ceil(50 * fraction))
        return {"synthesis_rounds": rounds, "warmup": min(rounds - 1, max(1, math.ceil(10 * fraction)))}
    return {}

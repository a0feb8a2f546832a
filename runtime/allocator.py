"""Fixed glibc ``malloc`` thresholds for every fcl-emu process (:func:`fcl_emu.runtime.process.setup_process`, first
thing).

glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and returns it with ``munmap`` on
free; the threshold starts at 128 KiB and moves with the sizes freed, and the heap's top is trimmed back to
the system above a trim threshold that moves with it. Torch's CPU temporaries of a training or evaluation
batch are 3-50 MB (the ``cnn``'s 28x28x64 activations: 6.4 MB at batch 32, 25.7 MB at 128), so under the
moving thresholds they keep coming back as fresh mappings whose every page faults in on first touch. Fixing
both thresholds at :data:`THRESHOLD` keeps them in the heap: an evaluation of MNIST's test set at batch 128,
one thread, took 1.2-1.5 s before and 0.57-0.63 s after (five in a row, each setting in its own process),
an epoch of a client's training (600 samples, batch 32) 0.20-0.23 s before and 0.18 s after; the process
holds at most about 15 MB more (freed memory below the trim threshold stays in the heap).

In the heap, a small block that outlives a batch pins the freed temporaries around it: the evaluation once
kept each batch's 1 KB of predictions in a list, and the coordinator grew by up to 400 MB within one
evaluation in about every other run (all of it freed at its end). Loops over batches write their small
results into a buffer allocated before the loop (``coordinator/evaluation.py``).

(The opposite setting, a low mmap threshold to give freed message buffers back to the system, made every
torch temporary an mmap/munmap pair and slowed local training about 20-fold.)
"""

from __future__ import annotations

import ctypes
import sys

THRESHOLD = 32 << 20  # bytes; glibc's own ceiling for the moving mmap threshold on 64-bit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def fix_malloc_thresholds(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold`` bytes; False where this is not glibc on Linux
    (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1

"""glibc's malloc thresholds fixed for torch's batch-sized temporaries (runtime/allocator.py), in a fresh
process so the test process's allocator is left as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes
    from fcl_emu.runtime.allocator import fix_malloc_thresholds

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_blocks_for(size):
        before = libc.mallinfo2().hblks
        block = libc.malloc(size)
        during = libc.mallinfo2().hblks
        libc.free(block)
        return during - before

    print(mapped_blocks_for(8 << 20), fix_malloc_thresholds(), mapped_blocks_for(8 << 20),
          mapped_blocks_for(64 << 20))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_batch_sized_blocks_come_from_the_heap_once_fixed():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # 8 MB: its own mapping under glibc's default, the heap once fixed; 64 MB (above the threshold): a mapping
    assert out.stdout.split() == ["1", "True", "0", "1"]

"""Process-level settings a run can opt into (`train.release_memory`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def return_freed_memory(threshold_bytes: int = 1 << 20) -> bool:
    """Serve allocations above `threshold_bytes` with their own mappings, so freeing one gives the memory
    back to the OS at once. glibc's default threshold grows up to 32 MB as large blocks are freed, after
    which a training step's temporary tensors (logit chunks, activations, merged weights) stay in the heap
    and the peak resident memory ratchets up: on the SmolLM2 GRPO benchmark config 5.5 GB instead of 3.2 GB.
    The price is a page-fault and unmap per large allocation: the demo's training took 174 s instead of
    116 s (docs/benchmarks.md). Returns False where it does not apply (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False

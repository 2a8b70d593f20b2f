"""Process-level settings a run can opt into (`train.release_memory`), and the umask for files rlora publishes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

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


def _umask() -> int:
    try:  # Linux says it without changing it (a probe would change it for every thread for a moment)
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # elsewhere: set and put back; the moment between errs on the private side
    os.umask(mask)
    return mask


def as_if_created(path: Path | str) -> None:
    """Give a file or folder made by tempfile (0600 / 0700, so that no one reads it half-written) the permissions a
    plain open()/mkdir() would have given it under the process's umask, before it is renamed into place: a merged
    model or an adapter must be readable by whoever reads the user's other files (a server under another uid).
    A folder's contents are set too. Best effort: a file system without Unix modes (vfat) keeps what it has; a
    folder's default ACL is not consulted (the umask decides, as for a file created without one)."""
    mask = _umask()
    root = Path(path)
    for item in [root, *(root.rglob("*") if root.is_dir() else ())]:
        if not item.is_symlink():
            try:
                os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
            except OSError:
                pass

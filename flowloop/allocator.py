"""Keep freed tensor memory in the process instead of handing it back to the kernel (glibc only).

Why: PyTorch's CPU allocator is plain ``malloc``. glibc serves large blocks (a batch's activations,
several MB each) with ``mmap`` and returns freed heap tops to the kernel, so every forward pass
maps fresh pages and takes a page fault on each first touch: measured on the shipped tiny DiT on
a 2-core EPYC, thousands of minor faults per forward (batch 16: 3,200-9,400), none with the
settings below, and about 10% more rollout throughput and 8-10% shorter training steps
(`benchmarks/results/bench_cpu_rollout_server.txt`). The results are bit-for-bit the same: only
where memory comes from changes. The cost is that the process keeps its peak heap size until it
exits.

It changes the whole process, so only entry points opt in: `flowloop.cli.main` calls
`keep_freed_memory` once for every command (and `benchmarks/rollout_server.py` for its figures);
no library constructor does. A program that embeds flowloop calls it itself if it wants it.
Ray actors started from a process that opted in get the same settings through glibc's
environment variables (`malloc_env`), read when the actor's process starts.
``FLOWLOOP_MALLOC_TUNING=0`` leaves the allocator alone even then. Elsewhere than glibc (macOS,
musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks below 32 MiB (glibc's largest allowed value) come from the heap, where freed ones are reused."""
TRIM_THRESHOLD = 2**31 - 1
"""Keep up to 2 GiB of free heap top (mallopt takes a C int): the next batch needs it again."""
TOP_PAD = 64 * 1024 * 1024
"""Grow the heap 64 MiB at a time, so a training step's activations need few ``brk`` calls."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("FLOWLOOP_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not ok:
        logger.debug("mallopt refused a setting; the allocator keeps glibc's defaults for it")
    _applied = ok
    return ok


def malloc_env() -> dict[str, str]:
    """The same settings as glibc environment variables, for child processes (Ray actors) of a
    process where `keep_freed_memory` is in effect; empty otherwise."""
    if not _applied:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
            "MALLOC_TOP_PAD_": str(TOP_PAD)}

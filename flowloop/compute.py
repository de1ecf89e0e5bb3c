"""One thread for all of a process's torch compute: the rollout engine's batches and the update.

Why one: PyTorch's CPU build parallelises with libgomp, which gives every thread that enters a
parallel region its own team of worker threads. Once two threads have done so (say the rollout
server's executor and the trainer's main thread), the process holds more OpenMP threads than
CPUs, and libgomp cuts the spin-wait of every team by a factor of 100 to 1000: each parallel
region then waits on futexes, and on a 2-core machine a forward pass ran 1.6-2x slower, even with
the other thread idle. Running both on this one thread keeps a single team. On a GPU it costs
nothing: kernels are queued from whichever thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def compute_executor() -> ThreadPoolExecutor:
    """The process's compute thread (created on first use; idle threads cost nothing)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowloop-compute",
                                           initializer=_remember_thread)
        return _executor


def run_compute(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, blocking until done; called from the compute
    thread itself it runs in place (no deadlock)."""
    if threading.get_ident() == _thread_ident:
        return fn(*args, **kwargs)
    return compute_executor().submit(fn, *args, **kwargs).result()


def _remember_thread() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()

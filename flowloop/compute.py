"""The threads a process samples on: one compute thread for the rollout server's batches (and other
torch work that wants it), and, on small CPUs, shard threads that run slices of a large batch.

Why: PyTorch's CPU build parallelises with libgomp, which gives every thread that enters a
parallel region its own team of worker threads. Once two threads have done so, the process holds
more OpenMP threads than CPUs and libgomp cuts every team's spin-wait 100-1000x, so each parallel
region waits on futexes: on a 2-core machine a batch-1 sampling loop ran at 7.2 instead of 12.2
samples/s while an idle second thread with its own team existed. Servers share this one thread
instead of each starting its own, and a caller that puts its other torch work here too (as
`benchmarks/rollout_server.py` does, model set-up included) keeps a single team. In
`flowloop train` the actor's update runs here too (`flowloop.trainer.model_worker`), so sampling
and training never overlap on one device; the main thread only stacks batches. On a GPU the
thread costs nothing: kernels are queued from whichever thread.

Nothing here runs on import or changes another thread's settings: the compute thread starts on
first use, and shard threads (each with its own intra-op thread count) only for an engine built
with ``cpu_shards`` other than 1, which `flowloop train` asks for through
``rollout.server.cpu_shards`` (auto by default). Process-wide thread counts are the entry
point's to set (``trainer.num_threads``, applied in the recipe's ``setup``).
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


# -- CPU shards -------------------------------------------------------------------------------
# On two cores, a small model's batch runs faster as slices on separate cores, each slice on one
# intra-op thread, than as one batch whose every op is split across the cores: small elementwise ops,
# layer norms and attention of a few hundred rows gain little from a second thread but pay its
# fork/join each time (shipped tiny DiT, 2 cores, batch 64: 3.3-3.9 vs 4.2-4.6 ms a sample).
_shard_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def shard_executor(num_shards: int, threads_per_shard: int) -> ThreadPoolExecutor:
    """``num_shards`` threads whose torch ops each use ``threads_per_shard`` intra-op threads.

    ``torch.set_num_threads`` sets the calling thread's OpenMP/MKL thread count and also the
    process-wide default that threads created later start with; so every shard thread is
    started here at once (a barrier), then the caller's own count is set again, leaving the
    default as it was for everyone else.
    """
    import torch

    key = (num_shards, threads_per_shard)
    with _lock:
        if key not in _shard_pools:
            own = torch.get_num_threads()
            barrier = threading.Barrier(num_shards)
            pool = ThreadPoolExecutor(max_workers=num_shards, thread_name_prefix=f"flowloop-shard{threads_per_shard}t",
                                      initializer=_use_threads, initargs=(threads_per_shard,))
            for future in [pool.submit(barrier.wait) for _ in range(num_shards)]:
                future.result()
            torch.set_num_threads(own)
            _shard_pools[key] = pool
        return _shard_pools[key]


def _use_threads(count: int) -> None:
    import torch

    # A thread's first torch parallel op sets its count to the process default; do that first,
    # or it would later undo the set below (and a team of the default size would join the CPUs).
    torch.get_num_threads()
    torch.set_num_threads(count)

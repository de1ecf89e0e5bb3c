"""`RolloutServer`: one request per `generate` call in, well-filled engine batches out.

Four parts, as in vLLM's engine core:

- intake (`generate`): validate the request (a bad one fails only its own call), queue it under
  its ``sampling_params.batch_key()``, await its future;
- scheduler (one asyncio task, started lazily in the running loop on the first `generate`): first
  the requests a caller has flushed (`flush`: "these are all of my batch"), as soon as every one of
  them is queued, as batches of their own; otherwise the group whose oldest request waited
  longest, when it holds ``max_batch_size`` requests or its oldest request has waited
  ``max_wait_ms``;
- executor: `RolloutEngine.sample` off the event loop, so intake never stalls; one batch at a
  time, on the process's compute thread (`flowloop.compute`) unless the server is given its own
  executor;
- output: each future gets its `DiffusionOutput`, with ``queue_time`` added to its metrics.

A caller that knows its batch is complete calls `flush` with its request ids, so the batch runs
without waiting out ``max_wait_ms`` and holds exactly those requests whichever order they arrive
in: `AgentLoopWorker` does so once every unfinished row of a `generate_sequences` call is waiting
on a replica. With a long ``max_wait_ms`` and a ``max_batch_size`` above any caller's batch, the
flushes alone form the batches, so two runs batch the same rows without depending on timing.

Lifecycle: `abort(request_id)` cancels a request (its caller gets `asyncio.CancelledError`; a
request already running finishes with its batch and its result is dropped), `pause()` waits for
the running batch and holds new ones (weight updates), `resume()`, `stop()`. Call them from the
server's event loop. The class works as a Ray async actor unchanged: ``ray.remote(RolloutServer)``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from flowloop.compute import compute_executor

from flowloop.rollout.engine import RolloutEngine
from flowloop.rollout.types import DiffusionOutput, RolloutRequest, StaleWeightsError

__all__ = ["RolloutServer"]

FLUSH_EXPIRY_S = 600.0
"""A flush whose requests have not all arrived after this long is forgotten (one may have gone to
another replica); its queued requests run by the usual rules meanwhile anyway."""


@dataclass
class _Pending:
    request: RolloutRequest
    future: asyncio.Future
    arrival: float
    """``time.perf_counter()`` at intake."""


@dataclass
class _Flush:
    request_ids: list[str]
    """Not yet taken into a batch, in the caller's order."""
    created: float


class RolloutServer:
    """Async dynamic batching in front of one `RolloutEngine`."""

    def __init__(self, engine: RolloutEngine, max_batch_size: int = 16, max_wait_ms: float = 5.0,
                 executor: Executor | None = None):
        """``executor``: where batches run; None = the process's compute thread (`flowloop.compute`).
        Give in-process replicas on different GPUs each their own to run them concurrently."""
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        self.engine = engine
        self._executor = executor or compute_executor()  # its thread starts on the first batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._paused = False
        self._stats = _Stats()
        self.weight_version: int | None = None
        """The trainer's update count behind the weights now loaded (`update_weights`); every output
        sampled with them carries it as ``extra_fields["weight_version"]``. None: never updated."""

    # -- intake -------------------------------------------------------------------------
    async def generate(self, request: RolloutRequest) -> DiffusionOutput:
        """Sample one request; raises ValueError (naming the field) for a bad one, at once."""
        self._start()
        if request.request_id in self._outstanding:
            raise ValueError(f"request_id {request.request_id!r} is already outstanding on this server")
        try:
            self.engine.validate(request)
            wanted = request.sampling_params.weight_version
            if wanted is not None and wanted != self.weight_version:
                raise StaleWeightsError(f"request {request.request_id} needs the weights of update {wanted}; "
                                        f"this replica holds {self.weight_version}")
        except (ValueError, StaleWeightsError):
            self._stats.rejected += 1
            raise
        pending = _Pending(request, self._loop.create_future(), time.perf_counter())
        self._outstanding[request.request_id] = pending
        self._queues.setdefault(request.sampling_params.batch_key(), deque()).append(pending)
        self._wakeup.set()
        try:
            return await pending.future
        finally:
            self._outstanding.pop(request.request_id, None)

    async def flush(self, request_ids: Iterable[str]) -> None:
        """Run these requests as soon as every one of them is queued, as batches of their own (in
        the order given, ``max_batch_size`` at most each), without waiting for ``max_wait_ms``.
        Ids may arrive after the flush; one already running or finished is left out, and one that
        is aborted no longer holds the others back."""
        self._start()
        queued = {p.request.request_id for queue in self._queues.values() for p in queue}
        taken = {i for i in self._outstanding if i not in queued}  # running, or done and not yet collected
        ids = [i for i in dict.fromkeys(request_ids) if i not in taken]
        if ids:
            self._flushes.append(_Flush(ids, time.perf_counter()))
            self._wakeup.set()

    @property
    def num_outstanding(self) -> int:
        """Requests accepted and not yet answered (queued or running)."""
        return len(self._outstanding) if self._loop is not None else 0

    # -- lifecycle ----------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Cancel a request: its `generate` raises CancelledError. False if it is not outstanding."""
        pending = self._outstanding.get(request_id) if self._loop is not None else None
        if pending is None or pending.future.done():
            return False
        pending.future.cancel()
        self._stats.aborted += 1
        self._wakeup.set()
        return True

    async def pause(self) -> None:
        """Hold new batches; returns once the running batch (if any) has finished."""
        self._paused = True
        if self._loop is not None and self._batch_task is not None and not self._batch_task.done():
            await asyncio.wait([self._batch_task])

    def resume(self) -> None:
        """Let the scheduler start batches again."""
        self._paused = False
        if self._loop is not None:
            self._wakeup.set()

    async def update_weights(self, state: dict | None, version: int) -> None:
        """Load new trainable weights (all of them, or LoRA adapters only) between batches: the
        running batch finishes with the old ones; queued requests then sample with the new ones,
        except those that named another version, which are refused (`StaleWeightsError`) when
        their batch would start, so the client can send them where those weights are.
        ``version`` is recorded in every output sampled afterwards. ``state`` None: the engine
        already holds them (its model is the trainer's own), only the version changes."""
        self._start()
        was_paused = self._paused
        await self.pause()
        try:
            if state is not None:
                await self._loop.run_in_executor(self._executor, self.engine.load_weights, state)
            self.weight_version = int(version)
        finally:
            if not was_paused:
                self.resume()

    async def stop(self) -> None:
        """Finish the running batch, cancel queued requests, end the scheduler (an executor passed
        in stays the caller's to shut down)."""
        self._stopped = True
        if self._loop is None:
            return
        self._scheduler.cancel()
        await asyncio.gather(self._scheduler, return_exceptions=True)
        if self._batch_task is not None:
            await asyncio.wait([self._batch_task])
        for pending in list(self._outstanding.values()):
            pending.future.cancel()

    def metrics(self) -> dict[str, float]:
        """Since the server started: request counts (outstanding, queued, running, completed, failed,
        aborted, rejected at intake), batches and their mean / largest size, queue time (intake to
        batch start), and ``samples_per_s`` = samples run / seconds the engine was busy."""
        s = self._stats
        queued = sum(len(q) for q in self._queues.values()) if self._loop is not None else 0
        return {
            "num_outstanding": float(self.num_outstanding),
            "num_queued": float(queued),
            "num_running": float(s.running),
            "num_completed": float(s.completed),
            "num_failed": float(s.failed),
            "num_aborted": float(s.aborted),
            "num_rejected": float(s.rejected),
            "num_batches": float(s.batches),
            "mean_batch_size": s.samples / s.batches if s.batches else 0.0,
            "max_batch_size_seen": float(s.max_batch),
            "mean_queue_time_s": s.queue_time / s.samples if s.samples else 0.0,
            "max_queue_time_s": s.max_queue_time,
            "engine_time_s": s.engine_time,
            **{f"engine_{phase}_s": seconds for phase, seconds in self.engine.phase_seconds.items()},
            "samples_per_s": s.samples / s.engine_time if s.engine_time else 0.0,
            "paused": float(self._paused),
        }

    # -- scheduler and executor ---------------------------------------------------------
    def _start(self) -> None:
        """Bind to the running loop on first use (a closed previous loop is left behind)."""
        if self._stopped:
            raise RuntimeError("RolloutServer is stopped")
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("RolloutServer is already serving another running event loop")
        self._loop = loop
        self._queues: dict[tuple, deque[_Pending]] = {}
        self._outstanding: dict[str, _Pending] = {}
        self._flushes: list[_Flush] = []
        self._wakeup = asyncio.Event()
        self._batch_task: asyncio.Task | None = None
        self._scheduler = loop.create_task(self._schedule(), name="rollout-scheduler")

    async def _schedule(self) -> None:
        while True:
            batch = await self._next_batch()
            self._batch_task = self._loop.create_task(self._run_batch(batch))
            await asyncio.shield(self._batch_task)  # stop() cancels the scheduler, not the batch

    async def _next_batch(self) -> list[_Pending]:
        """Wait for a flushed batch whose requests are all queued, a full batch, or for the oldest
        request's ``max_wait_ms`` to run out."""
        while True:
            self._drop_cancelled()
            timeout = None
            if self._queues and not self._paused:
                batch = self._flushed_batch()
                if batch:
                    return batch
                key, queue = min(self._queues.items(), key=lambda item: item[1][0].arrival)
                waited = time.perf_counter() - queue[0].arrival
                if len(queue) >= self.max_batch_size or waited >= self.max_wait_s:
                    batch = [queue.popleft() for _ in range(min(self.max_batch_size, len(queue)))]
                    if not queue:
                        del self._queues[key]
                    self._forget_flushed(batch)
                    return batch
                timeout = self.max_wait_s - waited
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass

    def _flushed_batch(self) -> list[_Pending]:
        """The first flush whose requests are all queued: its first ``max_batch_size`` requests
        of one batch key (the rest stay flushed and queued, so they come next)."""
        queued = {p.request.request_id: p for queue in self._queues.values() for p in queue}
        now = time.perf_counter()
        self._flushes = [f for f in self._flushes if f.request_ids and now - f.created < FLUSH_EXPIRY_S]
        for flush in self._flushes:
            if all(i in queued for i in flush.request_ids):
                key = queued[flush.request_ids[0]].request.sampling_params.batch_key()
                batch = [queued[i] for i in flush.request_ids if queued[i].request.sampling_params.batch_key() == key]
                batch = batch[:self.max_batch_size]
                taken = {id(p) for p in batch}
                self._queues[key] = deque(p for p in self._queues[key] if id(p) not in taken)
                if not self._queues[key]:
                    del self._queues[key]
                self._forget_flushed(batch)
                return batch
        return []

    def _forget_flushed(self, batch: list[_Pending]) -> None:
        """Requests taken into a batch no longer belong to any flush."""
        ids = {p.request.request_id for p in batch}
        for flush in self._flushes:
            flush.request_ids = [i for i in flush.request_ids if i not in ids]

    def _drop_cancelled(self) -> None:
        dropped = []
        for key in list(self._queues):
            dropped += [p for p in self._queues[key] if p.future.done()]
            queue = deque(p for p in self._queues[key] if not p.future.done())
            if queue:
                self._queues[key] = queue
            else:
                del self._queues[key]
        if dropped:
            self._forget_flushed(dropped)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        batch = self._refuse_stale(batch)
        if not batch:
            return
        start = time.perf_counter()
        s = self._stats
        s.running = len(batch)
        try:
            outputs = await self._loop.run_in_executor(self._executor, self.engine.sample, [p.request for p in batch])
        except Exception as err:  # a failed batch fails its own callers, never the server
            s.failed += len(batch)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(err)
            return
        finally:
            s.running = 0
        s.record_batch(batch, start, time.perf_counter())
        for pending, output in zip(batch, outputs):
            output.metrics["queue_time"] = start - pending.arrival
            if self.weight_version is not None:
                output.extra_fields["weight_version"] = torch.tensor(self.weight_version)
            if not pending.future.done():  # aborted while running: the result is dropped
                pending.future.set_result(output)


    def _refuse_stale(self, batch: list[_Pending]) -> list[_Pending]:
        """The requests of ``batch`` the loaded weights may serve; the others (queued before a
        weight update, naming the old version) fail with `StaleWeightsError`."""
        keep = []
        for pending in batch:
            wanted = pending.request.sampling_params.weight_version
            if wanted is None or wanted == self.weight_version:
                keep.append(pending)
            elif not pending.future.done():
                self._stats.rejected += 1
                pending.future.set_exception(StaleWeightsError(
                    f"request {pending.request.request_id} needs the weights of update {wanted}; "
                    f"this replica moved on to {self.weight_version} while it was queued"))
        return keep


@dataclass
class _Stats:
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    rejected: int = 0
    running: int = 0
    batches: int = 0
    samples: int = 0
    max_batch: int = 0
    queue_time: float = 0.0
    max_queue_time: float = 0.0
    engine_time: float = 0.0

    def record_batch(self, batch: list[_Pending], start: float, end: float) -> None:
        self.batches += 1
        self.samples += len(batch)
        self.completed += sum(not p.future.done() for p in batch)
        self.max_batch = max(self.max_batch, len(batch))
        self.engine_time += end - start
        for pending in batch:
            self.queue_time += start - pending.arrival
            self.max_queue_time = max(self.max_queue_time, start - pending.arrival)

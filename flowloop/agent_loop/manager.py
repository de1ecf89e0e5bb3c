"""`AgentLoopManager`: the trainer's one entry to rollout. It splits a batch over N
`AgentLoopWorker`s, runs the chunks concurrently, puts the rows back in order, applies the
reward failure policy and sums up the timings.

    manager = AgentLoopManager.create(config, model)            # local: one process, one loop
    manager = AgentLoopManager.create(config, model, "ray", 2)  # Ray actors, 2 rollout replicas
    out = manager.generate_sequences(batch)                     # Batch, see AgentLoopWorker
    future = manager.generate_sequences_future(batch)           # the same, while the caller works on
    manager.shutdown()

The manager's event loop runs in a thread of its own, where local replicas, reward workers and
agent-loop workers live across calls; every call is scheduled there, so a caller can train while
a batch generates (``rollout.max_staleness`` > 0). Weights never change under a batch:
`update_weights` waits for the batches in flight.

Both modes run the same code; only `flowloop.agent_loop.actors` (where handles are made and
how they are called) knows the difference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from flowloop.agent_loop.actors import call, check_mode, is_remote, make_actor, wait_ready
from flowloop.agent_loop.worker import ROW_INDEX_KEY, AgentLoopWorker, _gather_or_cancel
from flowloop.config.rollout import RolloutConfig
from flowloop.protocol import Batch
from flowloop.reward.worker import ERROR_KEY, RewardFailedError, RewardWorker
from flowloop.rollout.client import replica_restarting, replica_unusable
from flowloop.rollout.engine import RolloutEngine
from flowloop.rollout.server import RolloutServer

logger = logging.getLogger(__name__)

TIMED = ("generate_time", "queue_time", "reward_time")
RESTART_WAIT_S = 120.0
"""How long a weight update waits for a replica Ray is restarting; past it the replica is left
out (it refuses requests for the new weights, so nothing samples stale)."""


class AgentLoopManager:
    """Runs batches through agent-loop workers (objects or Ray actor handles).

    Args:
        workers: `AgentLoopWorker` objects (local) or actor handles (Ray).
        failure_policy: ``reward.failure_policy``: "fail" or "drop_group".
        owned: rollout servers and reward workers to stop in `shutdown` (besides ``workers``).
    """

    def __init__(self, workers: list, failure_policy: str = "fail", owned: list = ()):
        if not workers:
            raise ValueError("AgentLoopManager needs at least one worker")
        self.workers = list(workers)
        self.failure_policy = failure_policy
        self.owned = list(owned)
        self.borrowed: list = []
        """Handles in ``owned`` that another object made: `shutdown` stops them but leaves them alive."""
        self._loop = asyncio.new_event_loop()  # local objects live in this loop across calls
        self._thread = threading.Thread(target=self._loop.run_forever, name="flowloop-agent-loop", daemon=True)
        self._thread.start()
        self._generating: set[asyncio.Task] = set()
        """`generate_sequences_async` calls running now (touched on the loop's thread only)."""

    @classmethod
    def create(cls, config: RolloutConfig, model, mode: str = "local", num_replicas: int = 1,
               replicas: list | None = None) -> AgentLoopManager:
        """Build rollout replicas, reward workers and agent-loop workers from ``config``.

        ``model`` is a `FlowModel` (or anything with its ``tokenizer`` and ``max_sequence_length``
        when ``replicas`` are given); in Ray mode it is pickled into each replica's actor (Ray
        starts a local cluster if none is running). ``replicas``: rollout replicas someone else
        made and owns (a trainer's `ModelWorker`s), used instead of building ``num_replicas``
        servers. ``prompt_length`` and ``max_sequence_length`` left null in ``config`` become the
        model's ``max_sequence_length``.
        """
        check_mode(mode)
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        config.validate()
        config = dataclasses.replace(
            config,
            prompt_length=config.prompt_length or model.max_sequence_length,
            max_sequence_length=config.max_sequence_length or model.max_sequence_length,
        )
        # 1. Rollout replicas; 2. reward workers; 3. agent-loop workers, reaching both through handles.
        s = config.server
        servers = list(replicas) if replicas is not None else [
            make_actor(RolloutServer, mode, RolloutEngine(model, s.cpu_shards), s.max_batch_size, s.max_wait_ms)
            for _ in range(num_replicas)]
        rewards = []
        if config.reward.name is not None:
            r = config.reward
            rewards = [make_actor(RewardWorker, mode, r.name, r.max_batch_size, r.max_wait_ms, r.kwargs, r.timeout_s)
                       for _ in range(r.num_workers)]
        workers = [
            make_actor(AgentLoopWorker, mode, config, model.tokenizer, servers, rewards)
            for _ in range(config.agent.num_workers)
        ]
        manager = cls(workers, config.reward.failure_policy, owned=[*servers, *rewards])
        manager.borrowed = list(replicas or [])
        try:
            manager._run(wait_ready([*servers, *rewards, *workers]))
        except BaseException:
            manager.shutdown()
            raise
        return manager

    def _run(self, coroutine):
        """Run ``coroutine`` on the manager's loop and wait for its result (an interrupt cancels it)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    # -- generation ---------------------------------------------------------------------
    def generate_sequences(self, batch: Batch) -> Batch:
        """Blocking form of `generate_sequences_async`, run on the manager's own event loop."""
        return self._run(self.generate_sequences_async(batch))

    def generate_sequences_future(self, batch: Batch) -> Future:
        """`generate_sequences_async` started on the manager's loop; returns at once. The
        `concurrent.futures.Future` gives the Batch (or raises its error); cancelling it cancels
        the rows."""
        return asyncio.run_coroutine_threadsafe(self.generate_sequences_async(batch), self._loop)

    async def generate_sequences_async(self, batch: Batch) -> Batch:
        """Generate and score every row; rows come back in input order (see `AgentLoopWorker`).

        ``meta_info`` gains ``timing`` (wall times, per-row means and maxima) and
        ``reward_dropped_rows`` (rows removed by the ``drop_group`` policy).
        """
        task = asyncio.current_task()
        self._generating.add(task)
        try:
            return await self._generate(batch)
        finally:
            self._generating.discard(task)

    async def _generate(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        # 1. verl's column names and arrays; every row knows its place in the full batch, so its
        #    seed does not depend on the split.
        batch = verl_columns(batch)
        added_index = ROW_INDEX_KEY not in batch
        if added_index:
            batch = Batch(batch.tensors, dict(batch.non_tensors), batch.meta_info)
            batch[ROW_INDEX_KEY] = list(range(len(batch)))
        # 2. Split, run the chunks concurrently, concatenate in order.
        chunks = batch.chunk(min(len(self.workers), len(batch)))
        timed = [asyncio.ensure_future(_timed(call(worker, "generate_sequences", chunk)))
                 for worker, chunk in zip(self.workers, chunks)]
        results = await _gather_or_cancel(timed)  # one worker failing cancels its siblings' rows
        output = _concat([out for out, _ in results])
        if added_index:
            output = Batch(output.tensors, {k: v for k, v in output.non_tensors.items() if k != ROW_INDEX_KEY}, output.meta_info)
        # 3. Rows whose reward failed: fail the step, or drop their groups.
        rows_before = len(output)
        output = apply_failure_policy(output, self.failure_policy)
        output.meta_info["reward_dropped_rows"] = rows_before - len(output)
        output.meta_info["timing"] = _timing(output.meta_info["metrics"], [t for _, t in results], time.perf_counter() - start)
        return output

    def update_weights(self, replicas: list, state, version: int) -> None:
        """Have ``replicas`` (servers or `ModelWorker`s this manager routes to) sample with the
        weights of update ``version`` from now on (``state``: the weights, or None when each
        holds them already); on this manager's loop, where local replicas serve. Batches in
        flight finish with the weights they started with first."""

        async def one(replica):
            deadline = time.monotonic() + RESTART_WAIT_S
            while True:
                try:
                    return await call(replica, "update_weights", state, version)
                except Exception as err:  # a replica Ray is restarting: wait for it, within reason
                    if not replica_unusable(err):
                        raise
                    if not replica_restarting(err) or time.monotonic() > deadline:  # dead for good, or too slow
                        logger.warning("replica left out of the weight update to version %d: %s", version, err)
                        return None
                    await asyncio.sleep(0.5)

        async def every():
            if self._generating:
                await asyncio.wait(list(self._generating))
            await asyncio.gather(*(one(r) for r in replicas))

        self._run(every())

    # -- lifecycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Cancel batches in flight, stop servers and reward workers, end the actors (Ray mode) and
        close the event loop."""
        if self._loop.is_closed():
            return

        async def stop_all():
            for task in self._generating:
                task.cancel()
            await asyncio.gather(*self._generating, return_exceptions=True)
            await asyncio.gather(*(call(h, "stop") for h in self.owned if hasattr(h, "stop")), return_exceptions=True)

        try:
            self._run(stop_all())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        for handle in [*self.workers, *self.owned]:
            if is_remote(handle) and handle not in self.borrowed:
                import ray

                ray.kill(handle)
        self._loop.close()


NEGATIVE_PROMPT_COLUMNS = ("negative_prompt", "raw_negative_prompt")
"""The negative-prompt columns read: flowloop's, and verl's name for it (renamed on the way in)."""


def verl_columns(batch: Batch) -> Batch:
    """A batch as verl hands it over, in flowloop's columns: ``raw_negative_prompt`` becomes
    ``negative_prompt``; chat messages given as numpy object arrays (``np.array(messages,
    dtype=object)``, one row of message dicts per prompt) become lists. Any other column whose
    name says negative prompt is an error rather than silently unused."""
    columns = dict(batch.non_tensors)
    unknown = [k for k in columns if "neg" in k.lower() and k not in NEGATIVE_PROMPT_COLUMNS]
    if unknown:
        raise ValueError(f"column(s) {unknown} look like a negative prompt but are not read; name it "
                         f"'negative_prompt' (or verl's 'raw_negative_prompt')")
    if "raw_negative_prompt" in columns:
        if "negative_prompt" in columns:
            raise ValueError("the batch has both 'negative_prompt' and 'raw_negative_prompt'; keep one")
        columns["negative_prompt"] = columns.pop("raw_negative_prompt")
    for key in ("raw_prompt", "negative_prompt"):
        values = columns.get(key)
        if values is not None and any(isinstance(v, np.ndarray) for v in values):
            columns[key] = [list(v) if isinstance(v, np.ndarray) else v for v in values]
    if columns.keys() == batch.non_tensors.keys() and all(columns[k] is batch.non_tensors[k] for k in columns):
        return batch
    return Batch.from_dict(dict(batch.tensors.items()), columns, batch.meta_info)


def apply_failure_policy(batch: Batch, policy: str) -> Batch:
    """Resolve rows whose ``rm_scores`` is NaN (their reward failed; the error is in ``reward_error``).

    "fail": raise, naming the failed rows and their errors. "drop_group": drop every row that
    shares a ``uid`` with a failed row (each row is its own group without a ``uid`` column).
    """
    if "rm_scores" not in batch:
        return batch
    failed = torch.isnan(batch["rm_scores"][:, 0]).nonzero().flatten().tolist()
    if not failed:
        return batch
    errors = batch[ERROR_KEY] if ERROR_KEY in batch else [None] * len(batch)
    prompts = batch["raw_prompt"] if "raw_prompt" in batch else [None] * len(batch)
    first = failed[0]
    prompt = repr(prompts[first]) if len(repr(prompts[first])) <= 120 else repr(prompts[first])[:100] + "...' (cut)"
    summary = (f"reward failed for {len(failed)} of {len(batch)} rows (rows {failed[:8]}); row {first} "
               f"(prompt {prompt}): {errors[first]}")
    if policy == "fail":
        raise RewardFailedError(f"{summary}. rollout.reward.failure_policy='fail' stops the step; "
                                "set it to 'drop_group' to drop those rows' groups instead.")
    groups = batch["uid"] if "uid" in batch else list(range(len(batch)))
    bad = {groups[i] for i in failed}
    keep = [i for i in range(len(batch)) if groups[i] not in bad]
    if not keep:
        raise RewardFailedError(f"{summary}. Every group has a failed row, so drop_group left nothing.")
    logger.warning("%s; dropping %d rows in %d groups", summary, len(batch) - len(keep), len(bad))
    return batch[keep]


async def _timed(coroutine):
    start = time.perf_counter()
    result = await coroutine
    return result, time.perf_counter() - start


def _concat(batches: list[Batch]) -> Batch:
    """`Batch.concat` after giving every chunk the same non-tensor columns (a reward extra key
    that only some chunks produced is None in the others)."""
    keys = list(dict.fromkeys(k for b in batches for k in b.non_tensors))
    reward_keys = list(dict.fromkeys(k for b in batches for k in b.meta_info.get("reward_extra_keys", [])))
    filled = []
    for b in batches:
        non_tensors = {k: b.non_tensors[k] if k in b.non_tensors else [None] * len(b) for k in keys}
        meta = dict(b.meta_info)
        if "reward_extra_keys" in meta:
            meta["reward_extra_keys"] = reward_keys
        filled.append(Batch.from_dict(dict(b.tensors.items()), non_tensors, meta))
    return Batch.concat(filled)


def _timing(rows: list[dict], worker_times: list[float], wall: float) -> dict[str, float]:
    """Batch-level timings in seconds: the call's wall time, the slowest and fastest worker,
    and the mean and max over rows of each per-row timing."""
    timing = {
        "agent_loop/generate_sequences": wall,
        "agent_loop/worker_max": max(worker_times),
        "agent_loop/worker_min": min(worker_times),
    }
    timing["agent_loop/retries"] = float(sum(row.get("retries", 0.0) for row in rows))
    for key in TIMED:
        values = torch.tensor([row[key] for row in rows], dtype=torch.float64)
        if len(values):
            timing[f"agent_loop/{key}/mean"] = float(values.mean())
            timing[f"agent_loop/{key}/max"] = float(values.max())
    return timing

"""`AgentLoopWorker`: runs one agent loop per row of a batch, streams each finished sample to a
reward worker, and stacks the rows into the output `Batch` of DESIGN.md "Contracts".

One class for both modes: locally the manager holds the object, in Ray mode a Ray actor runs
it; the rollout replicas and reward workers it is given are objects or actor handles alike.

Once every unfinished row of a call is waiting on a rollout replica, no more requests of that
call can come, so the worker flushes them (`RolloutServer.flush`): the replica runs them at once,
as batches of their own, instead of waiting out ``rollout.server.max_wait_ms`` for more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from typing import Any

import torch

from flowloop.agent_loop import single_turn  # noqa: F401  (registers "single_turn")
from flowloop.agent_loop.actors import call
from flowloop.agent_loop.base import AgentLoopOutput, prompt_text
from flowloop.agent_loop.registry import agent_loop_config, instantiate_agent_loop, load_agent_loop_configs
from flowloop.config.rollout import RolloutConfig
from flowloop.models.base import is_sequence_embedding_key
from flowloop.protocol import Batch, pad_to_length, to_object_array
from flowloop.reward.worker import RewardSample
from flowloop.rollout.client import RolloutClient
from flowloop.rollout.types import RolloutRequest, SamplingParams

logger = logging.getLogger(__name__)

ROW_INDEX_KEY = "global_row_index"
"""Non-tensor column: a row's index in the trainer's full batch (seeds depend on it, not on
which worker ran the row). The manager fills it with row positions when the trainer does not."""
AGENT_NAME_KEY = "agent_name"
"""Optional non-tensor column naming each row's agent loop."""
VALIDATION_STEP = -1
"""The ``global_step`` validation seeds use, so they never coincide with a training step's."""


def row_seed(base_seed: int, global_step: int, global_row_index: int | str) -> int:
    """The seed of one row: the first 8 bytes of BLAKE2b over ``"base:step:row"``, as an integer
    in [0, 2**63). Stable across processes, machines and Python versions (unlike ``hash()``)."""
    digest = hashlib.blake2b(f"{base_seed}:{global_step}:{global_row_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class AgentLoopWorker:
    """Turns a batch of prompts into a batch of trajectories, one asyncio task per row.

    Args:
        config: the rollout config, with ``prompt_length`` and ``max_sequence_length`` resolved
            (`AgentLoopManager.create` fills them from the model).
        tokenizer: the model's fast tokenizer; used on this worker's event-loop thread only.
        rollout_replicas: `RolloutServer` objects or Ray actor handles; one `RolloutClient`
            over them balances this worker's requests.
        reward_workers: `RewardWorker` objects or handles; row r goes to ``r % len``. None or
            empty: nothing is scored and the output has no ``rm_scores``.
    """

    def __init__(self, config: RolloutConfig, tokenizer, rollout_replicas: list, reward_workers: list | None = None):
        config.validate()
        if config.prompt_length is None or config.max_sequence_length is None:
            raise ValueError("prompt_length and max_sequence_length must be set; AgentLoopManager.create fills them from the model")
        self.config = config
        self.tokenizer = tokenizer
        self.client = RolloutClient(rollout_replicas)
        self.reward_workers = list(reward_workers or [])
        if config.agent.agent_loop_config_path:
            load_agent_loop_configs(config.agent.agent_loop_config_path)
        agent_loop_config(config.agent.default_agent_loop)  # an unknown default fails at start-up
        # Both modes' settings are checked once, here: a bad value fails before any batch runs.
        self._params = {validate: SamplingParams.from_dict(config.sampling_dict(validate)) for validate in (False, True)}
        for params in self._params.values():
            params.validate()

    async def generate_sequences(self, batch: Batch) -> Batch:
        """Generate (and score) every row of ``batch``.

        ``batch.meta_info``: ``validate`` (bool, default False) and, when training,
        ``global_steps`` (the trainer step, which seeds the rows). Non-tensor columns used:
        ``raw_prompt`` (required), ``agent_name``, ``global_row_index``, ``negative_prompt``,
        ``uid`` (the group);
        every input non-tensor column is carried to the output, input tensors are not.

        Returns a batch with tensors ``prompts`` ``[bsz, prompt_length]`` (left-padded),
        ``attention_mask``, ``responses`` ``[bsz, C, H, W]`` (or ``[bsz, T, C, H, W]``),
        ``rollout_log_probs`` ``[bsz, W]`` (training), the rollout's extra tensors
        (``all_latents``, ``all_timesteps``, ``prompt_embeds`` ``[bsz, max_sequence_length, D]``,
        ``prompt_embeds_mask``...; a replica may keep them instead and name them in a ``held_row``
        column: colocated trainer ranks do, `flowloop.trainer.held_rows`), ``rm_scores`` ``[bsz, 1]`` when rewards are on (NaN where the
        reward failed: the manager applies ``reward.failure_policy``); non-tensors
        ``__num_turns__`` and one column per reward extra key (``reward_error`` among them);
        ``meta_info["metrics"]`` (one dict per row) and ``meta_info["reward_extra_keys"]``.
        """
        if len(batch) == 0 or "raw_prompt" not in batch:
            raise ValueError(f"generate_sequences needs rows with a 'raw_prompt' non-tensor column, got {batch!r}")
        # 1. Sampling settings and one seed per row.
        validate = bool(batch.meta_info.get("validate", False))
        step = batch.meta_info.get("global_steps")
        if not validate and step is None:
            raise ValueError("a training batch needs meta_info['global_steps'] (it seeds the rows); "
                             "set meta_info['validate']=True for validation")
        params = dataclasses.replace(self._params[validate], global_steps=step,
                                     weight_version=batch.meta_info.get("weight_version"))
        row_indices = self._row_indices(batch)
        # verl's ``meta_info["rollout_seed"]`` replaces ``rollout.seed`` as the training base seed.
        train_seed = batch.meta_info.get("rollout_seed", self.config.seed)
        if isinstance(train_seed, bool) or not isinstance(train_seed, int) or train_seed < 0:
            raise ValueError(f"meta_info['rollout_seed'] must be an int >= 0, got {train_seed!r}")
        base_seed, seed_step = (self.config.val_kwargs.seed, VALIDATION_STEP) if validate else (train_seed, step)
        # 2. Which loop runs each row; an unknown name fails before anything runs.
        names = batch[AGENT_NAME_KEY] if AGENT_NAME_KEY in batch else [self.config.agent.default_agent_loop] * len(batch)
        for name in sorted(set(names)):
            agent_loop_config(name)
        # 3. One task per row; each streams its sample to a reward worker when it is done.
        hidden = (AGENT_NAME_KEY, ROW_INDEX_KEY)
        gate = _FlushingClient(self.client, len(batch))
        tasks = []
        for i, row_index in enumerate(row_indices):
            row = {key: column[i] for key, column in batch.non_tensors.items() if key not in hidden}
            row_params = dataclasses.replace(params, seed=row_seed(base_seed, seed_step, row_index))
            tasks.append(asyncio.create_task(self._run_row(names[i], row_params, row, row_index, gate)))
        results = await _gather_or_cancel(tasks)
        # 4. Pad and stack.
        return self._postprocess(batch, results, row_indices)

    async def _run_row(self, agent_name: str, params: SamplingParams, row: dict, row_index: int,
                       client: _FlushingClient):
        loop = instantiate_agent_loop(agent_name, client=client, tokenizer=self.tokenizer)
        try:
            output: AgentLoopOutput = await loop.run(params, **row)
        finally:
            client.row_done()
        reward_info: dict[str, Any] = {}
        if self.reward_workers and output.reward_score is None:
            start = time.perf_counter()
            sample = RewardSample(output.response_diffusion_output, prompt_text(row["raw_prompt"]), row)
            worker = self.reward_workers[row_index % len(self.reward_workers)]
            result = await call(worker, "compute_score", sample)
            output.metrics.reward_time = time.perf_counter() - start
            output.reward_score, reward_info = result.score, result.extra_info
        return output, reward_info

    def _row_indices(self, batch: Batch) -> list[int]:
        if ROW_INDEX_KEY not in batch:
            return list(range(len(batch)))
        indices = [int(i) for i in batch[ROW_INDEX_KEY]]
        if len(set(indices)) != len(indices):
            raise ValueError(f"non-tensor {ROW_INDEX_KEY!r} has repeated values; rows would share seeds")
        return indices

    # -- stacking -----------------------------------------------------------------------
    def _postprocess(self, batch: Batch, results: list[tuple[AgentLoopOutput, dict]], row_indices: list[int]) -> Batch:
        outputs = [output for output, _ in results]
        describe = _RowNamer(batch, row_indices)
        # 1. Prompt ids, left-padded; a prompt too long is an error naming the row.
        length = self.config.prompt_length
        for i, output in enumerate(outputs):
            if output.prompt_ids.shape[0] > length:
                raise ValueError(f"{describe(i)} has {output.prompt_ids.shape[0]} prompt tokens, more than "
                                 f"prompt_length={length}; raise prompt_length or shorten the prompt")
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        tensors = {
            "prompts": pad_to_length([o.prompt_ids for o in outputs], length, pad_id, "left"),  # [bsz, prompt_length]
            "attention_mask": pad_to_length([torch.ones_like(o.prompt_ids) for o in outputs], length, 0, "left"),
            "responses": _stack("responses", [o.response_diffusion_output for o in outputs]),  # [bsz, C, H, W]
        }
        # 2. Log-probs over the SDE window.
        logprobs = [o.response_logprobs for o in outputs]
        if any(lp is not None for lp in logprobs):
            if any(lp is None for lp in logprobs):
                raise ValueError(f"{describe(logprobs.index(None))} has no log-probs but other rows do")
            tensors["rollout_log_probs"] = _stack("rollout_log_probs", logprobs)  # [bsz, W]
        # 3. The rollout's extra tensors; prompt embeddings padded to max_sequence_length.
        tensors.update(self._extra_tensors(outputs, describe))
        # 4. Rewards: NaN marks a failed row, whose error is in the reward_error column.
        scores = [o.reward_score for o in outputs]
        scored = bool(self.reward_workers) or all(s is not None for s in scores)
        if scored:
            values = [float("nan") if s is None else s for s in scores]
            tensors["rm_scores"] = torch.tensor(values, dtype=torch.float32).unsqueeze(-1)  # [bsz, 1]
        # 5. Non-tensor columns and per-row metrics.
        non_tensors = dict(batch.non_tensors)
        non_tensors["__num_turns__"] = [o.num_turns for o in outputs]
        reward_keys = list(dict.fromkeys(key for _, info in results for key in info))
        for key in reward_keys:
            _add_column(non_tensors, key, [info.get(key) for _, info in results], "reward extra info")
        for key in dict.fromkeys(k for o in outputs for k, v in o.extra_fields.items() if not isinstance(v, torch.Tensor)):
            _add_column(non_tensors, key, [o.extra_fields.get(key) for o in outputs], "agent-loop extra field")
        meta = dict(batch.meta_info)
        meta["metrics"] = [o.metrics.model_dump() for o in outputs]
        if scored:
            meta["reward_extra_keys"] = reward_keys
        return Batch.from_dict(tensors, non_tensors, meta)

    def _extra_tensors(self, outputs: list[AgentLoopOutput], describe) -> dict[str, torch.Tensor]:
        rows = [{k: v for k, v in o.extra_fields.items() if isinstance(v, torch.Tensor)} for o in outputs]
        return stack_extra_tensors(rows, self.config.max_sequence_length, describe)


def stack_extra_tensors(rows: list[dict[str, torch.Tensor]], max_sequence_length: int, describe) -> dict[str, torch.Tensor]:
    """The rows' rollout tensors as batch columns ``[bsz, ...]``; prompt embeddings right-padded
    to ``max_sequence_length``. Every row must hold the same keys; ``describe(i)`` names row i."""
    keys = list(rows[0])
    for i, row in enumerate(rows):
        if sorted(row) != sorted(keys):
            raise ValueError(f"{describe(i)} has extra tensors {sorted(row)} but row 0 has {sorted(keys)}")
    stacked = {}
    for key in keys:
        values = [row[key] for row in rows]
        if is_sequence_embedding_key(key):
            for i, value in enumerate(values):
                if value.shape[0] > max_sequence_length:
                    raise ValueError(f"{describe(i)}: {key} has {value.shape[0]} tokens, more than "
                                     f"max_sequence_length={max_sequence_length}; raise max_sequence_length or shorten the prompt")
            stacked[key] = pad_to_length(values, max_sequence_length, 0, "right")  # [bsz, max_sequence_length(, D)]
        else:
            stacked[key] = _stack(key, values)  # e.g. all_latents [bsz, W+1, C, H, W]
    return stacked


class _FlushingClient:
    """The client the rows of one `generate_sequences` call share: `RolloutClient.generate`, plus
    a flush of the waiting requests whenever every unfinished row is waiting on a replica."""

    def __init__(self, client: RolloutClient, rows: int):
        self.client = client
        self.live = rows
        self.waiting: list[str] = []
        self.flushed: set[str] = set()
        self.flushing: set[asyncio.Task] = set()

    async def generate(self, request: RolloutRequest):
        self.waiting.append(request.request_id)
        # Checked once this step has handed the request to a replica (`RolloutClient.generate`
        # sends it before its first await), and after the other rows ready to run have done so.
        asyncio.get_running_loop().call_soon(self._maybe_flush)
        try:
            return await self.client.generate(request)
        finally:
            self.waiting.remove(request.request_id)
            self.flushed.discard(request.request_id)

    def row_done(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def __getattr__(self, name: str):
        return getattr(self.client, name)  # abort, outstanding, ... as the client has them

    def _maybe_flush(self) -> None:
        fresh = [i for i in self.waiting if i not in self.flushed]
        if not fresh or len(self.waiting) < self.live:
            return
        self.flushed.update(fresh)
        task = asyncio.get_running_loop().create_task(self.client.flush(fresh))
        self.flushing.add(task)
        task.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task) -> None:
        self.flushing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the requests still run, on the clock
            logger.warning("flushing rollout requests failed: %r", task.exception())


class _RowNamer:
    """``describe(i)``: "row i (global row r, prompt '...')" for error messages."""

    def __init__(self, batch: Batch, row_indices: list[int]):
        self.prompts = batch["raw_prompt"] if "raw_prompt" in batch else [None] * len(batch)
        self.row_indices = row_indices

    def __call__(self, i: int) -> str:
        return f"row {i} (global row {self.row_indices[i]}, prompt {self.prompts[i]!r})"


def _stack(key: str, values: list[torch.Tensor]) -> torch.Tensor:
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"rows' {key!r} have different shapes {sorted(shapes)}; a batch needs one shape")
    return torch.stack(values)


def _add_column(non_tensors: dict, key: str, values: list, what: str) -> None:
    if key in non_tensors:
        raise ValueError(f"{what} key {key!r} clashes with the input column {key!r}; rename one of them")
    non_tensors[key] = to_object_array(values, key)


async def _gather_or_cancel(tasks: list[asyncio.Task]) -> list:
    """Results of all tasks in order; if one raises, cancel the others and re-raise."""
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

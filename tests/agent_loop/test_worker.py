"""`AgentLoopWorker` behaviour on the tiny random model: seeds, streaming, padding errors,
reward failures and their policies, agent-loop selection."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from flowloop.agent_loop import AgentLoopManager, AgentLoopWorker, registered_agent_loops, row_seed
from flowloop.config.rollout import AgentConfig, RewardConfig
from flowloop.protocol import Batch
from flowloop.reward import RewardWorker, register_reward
from flowloop.rollout import RolloutEngine, RolloutServer
from flowloop.tasks import shapes
from tests.agent_loop.helpers import EXAMPLE_YAML, PROMPTS, prompt_batch, small_config
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model()


def generate(config, model, batch, num_replicas: int = 1) -> Batch:
    manager = AgentLoopManager.create(config, model, num_replicas=num_replicas)
    try:
        return manager.generate_sequences(batch)
    finally:
        manager.shutdown()


@register_reward("test_fails_on_squares")
def fails_on_squares(images, prompts, metadata):
    if any("square" in p for p in prompts):
        raise ValueError("cannot score squares")
    return [0.5] * len(prompts), [{"seen": True} for _ in prompts]


# ---- seeds ------------------------------------------------------------------------------


def test_row_seed_is_a_stable_hash():
    assert row_seed(0, 1, 2) == 217875049918638303  # fixed forever: changing it changes every run
    seeds = {row_seed(b, s, r) for b in range(3) for s in range(3) for r in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**63 for s in seeds)


def test_a_rows_sample_does_not_depend_on_the_worker_split(model):
    batch = prompt_batch(4)
    one = generate(small_config(num_workers=1), model, batch)
    three = generate(small_config(num_workers=3), model, batch)
    for key in one.tensors.keys():
        assert torch.equal(one[key], three[key]), key
    # Two replicas each batch half the rows: matmul rounding may move the last bit, no more.
    two_replicas = generate(small_config(num_workers=3), model, batch, num_replicas=2)
    torch.testing.assert_close(two_replicas["responses"], one["responses"], atol=1e-6, rtol=0)
    # A trainer-given global_row_index places rows: rows 5..7 alone give rows 5..7 of the full batch.
    part = batch[[5, 6, 7]]
    part["global_row_index"] = [5, 6, 7]
    alone = generate(small_config(), model, part)
    assert list(alone["global_row_index"]) == [5, 6, 7]
    # The engine batches 3 rows instead of 16: the same bound.
    torch.testing.assert_close(alone["responses"], one["responses"][5:8], atol=1e-6, rtol=0)


def test_verl_rollout_seed_is_the_base_seed(model):
    """``meta_info["rollout_seed"]`` (verl's) seeds the rows as ``rollout.seed`` would."""
    batch = prompt_batch(2)
    default = generate(small_config(), model, batch)
    batch.meta_info["rollout_seed"] = 7
    seeded = generate(small_config(), model, batch)
    again = generate(dataclasses.replace(small_config(), seed=7), model, prompt_batch(2))
    assert torch.equal(seeded["responses"], again["responses"])
    assert not torch.equal(seeded["responses"], default["responses"])
    batch.meta_info["rollout_seed"] = -1
    with pytest.raises(ValueError, match="rollout_seed"):
        generate(small_config(), model, batch)


def test_training_batch_needs_its_step(model):
    batch = prompt_batch(1)
    del batch.meta_info["global_steps"]
    with pytest.raises(ValueError, match=r"meta_info\['global_steps'\]"):
        generate(small_config(), model, batch)


# ---- streaming --------------------------------------------------------------------------

_OUTSTANDING_AT_SCORING: list[int] = []
_SERVERS: list[RolloutServer] = []


@register_reward("test_records_rollout_load")
def records_rollout_load(images, prompts, metadata):
    _OUTSTANDING_AT_SCORING.append(_SERVERS[0].num_outstanding)
    return [1.0] * len(prompts), [{} for _ in prompts]


def test_samples_are_scored_while_others_are_still_generating(model):
    config = dataclasses.replace(small_config(reward="test_records_rollout_load"), prompt_length=16, max_sequence_length=16)

    _OUTSTANDING_AT_SCORING.clear()

    async def main():
        server = RolloutServer(RolloutEngine(model), max_batch_size=4)  # 16 rows: four engine batches in turn
        _SERVERS[:] = [server]
        reward = RewardWorker("test_records_rollout_load")
        worker = AgentLoopWorker(config, model.tokenizer, [server], [reward])
        try:
            return await worker.generate_sequences(prompt_batch(4))
        finally:
            await server.stop()
            await reward.stop()

    out = asyncio.run(main())
    assert out["rm_scores"].flatten().tolist() == [1.0] * 16
    assert _OUTSTANDING_AT_SCORING[0] >= 4  # the first batch was scored while later ones waited or ran


# ---- padding errors -----------------------------------------------------------------------


def test_prompt_longer_than_prompt_length_names_the_row(model):
    with pytest.raises(ValueError, match=r"row 0 \(global row 0, prompt 'a red circle'\) has 4 prompt tokens, more than prompt_length=3"):
        generate(small_config(prompt_length=3), model, prompt_batch(1))


def test_embeddings_longer_than_max_sequence_length_name_the_row(model):
    with pytest.raises(ValueError, match=r"row 0 .*prompt_embeds has 16 tokens, more than max_sequence_length=8"):
        generate(small_config(max_sequence_length=8), model, prompt_batch(1))


def test_negative_prompt_gives_negative_embeddings(model):
    config = small_config()
    config.pipeline.guidance_scale = 2.0
    batch = prompt_batch(1)
    batch["negative_prompt"] = ["a blue square"] * len(batch)
    out = generate(config, model, batch)
    assert out["negative_prompt_embeds"].shape == out["prompt_embeds"].shape == (4, 16, 32)
    assert list(out["negative_prompt"]) == ["a blue square"] * 4


# ---- reward failures ----------------------------------------------------------------------


def test_failed_reward_marks_its_row_and_never_becomes_zero(model):
    config = dataclasses.replace(small_config(reward="test_fails_on_squares"), prompt_length=16, max_sequence_length=16)

    async def main():
        server, reward = RolloutServer(RolloutEngine(model)), RewardWorker("test_fails_on_squares", max_batch_size=16)
        worker = AgentLoopWorker(config, model.tokenizer, [server], [reward])
        try:
            return await worker.generate_sequences(prompt_batch(2))
        finally:
            await server.stop()
            await reward.stop()

    out = asyncio.run(main())
    squares = ["square" in p for p in out["raw_prompt"]]
    scores = out["rm_scores"][:, 0]
    assert torch.isnan(scores[squares]).all() and (scores[[not s for s in squares]] == 0.5).all()
    assert [e for e, s in zip(out["reward_error"], squares) if s] == ["ValueError: cannot score squares"] * 2
    assert [e for e, s in zip(out["reward_error"], squares) if not s] == [None] * 6
    assert [v for v, s in zip(out["seen"], squares) if not s] == [True] * 6


def test_fail_policy_stops_the_step_naming_the_row(model):
    config = small_config(reward_config=RewardConfig(name="test_fails_on_squares", failure_policy="fail"))
    with pytest.raises(RuntimeError, match=r"reward failed for 4 of 16 rows.*'two blue squares'.*cannot score squares"):
        generate(config, model, prompt_batch(4))


def test_drop_group_policy_drops_the_failed_rows_groups(model):
    config = small_config(reward_config=RewardConfig(name="test_fails_on_squares", failure_policy="drop_group"))
    out = generate(config, model, prompt_batch(4))
    assert len(out) == 12 and "p1" not in set(out["uid"])
    assert (out["rm_scores"] == 0.5).all()
    assert out.meta_info["reward_dropped_rows"] == 4 and len(out.meta_info["metrics"]) == 12
    every_group_fails = prompt_batch(2, prompts=["two blue squares", "a red square"])
    with pytest.raises(RuntimeError, match="drop_group left nothing"):
        generate(config, model, every_group_fails)


# ---- agent loops ----------------------------------------------------------------------------


def test_unknown_agent_loop_lists_the_registered_ones(model):
    batch = prompt_batch(1)
    batch["agent_name"] = ["single_turn", "no_such_loop", "single_turn", "single_turn"]
    with pytest.raises(ValueError, match=r"unknown agent loop 'no_such_loop'; registered agent loops: \[.*'single_turn'"):
        generate(small_config(), model, batch)
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        AgentLoopManager.create(small_config(agent=AgentConfig(default_agent_loop="nope")), model)


def test_multi_turn_loop_from_outside_the_package_via_yaml(model):
    config = small_config(agent=AgentConfig(agent_loop_config_path=str(EXAMPLE_YAML)))
    batch = prompt_batch(2)
    batch["agent_name"] = ["single_turn", "retry_until_correct"] * 4
    out = generate(config, model, batch)
    assert "retry_until_correct" in registered_agent_loops()
    single = generate(small_config(), model, prompt_batch(2))
    for i in range(8):
        if out["agent_name"][i] == "single_turn":
            assert out["__num_turns__"][i] == 2 and out["attempt_scores"][i] is None
            assert torch.equal(out["responses"][i], single["responses"][i])
            continue
        attempts = out["attempt_scores"][i]
        assert 1 <= len(attempts) <= 3 and out["__num_turns__"][i] == 2 * len(attempts)
        # The trajectory returned (and scored) is the last attempt's.
        assert attempts[-1] == shapes.verify(out["responses"][i], out["raw_prompt"][i]).score == out["rm_scores"][i, 0]
        assert out["rollout_log_probs"][i].shape == single["rollout_log_probs"][i].shape


def test_prompts_cover_the_helpers_vocabulary():
    for prompt in PROMPTS:  # a typo here would fail every test above for the wrong reason
        shapes.parse_prompt(prompt)


def test_each_worker_flushes_its_rows_as_one_batch(model):
    """No clock and no full batch: two workers on one server each get their rows run as soon as
    all of them are waiting on it (`RolloutServer.flush`), as a batch of their own."""
    config = dataclasses.replace(small_config(reward=None), prompt_length=16, max_sequence_length=16)

    async def main():
        server = RolloutServer(RolloutEngine(model), max_batch_size=64, max_wait_ms=60_000)
        workers = [AgentLoopWorker(config, model.tokenizer, [server]) for _ in range(2)]
        try:
            outs = await asyncio.wait_for(asyncio.gather(workers[0].generate_sequences(prompt_batch(2)),
                                                         workers[1].generate_sequences(prompt_batch(1))), 60)
            return outs, server.metrics()
        finally:
            await server.stop()

    (a, b), metrics = asyncio.run(main())
    assert (len(a), len(b)) == (8, 4)
    assert metrics["num_batches"] == 2 and metrics["max_batch_size_seen"] == 8 and metrics["max_queue_time_s"] < 30

"""End to end through `AgentLoopManager` in local mode, on the embedded shapes model."""

from __future__ import annotations

import sys

import pytest
import torch

from flowloop.agent_loop import AgentLoopManager, encode_chat, chat_messages
from flowloop.models import load_flow_model
from flowloop.rollout.server import RolloutServer
from flowloop.tasks import shapes
from tests.agent_loop.helpers import CONTRACT_NON_TENSORS, CONTRACT_TENSORS, SHAPES_EXTRA_KEYS, prompt_batch, small_config

STEPS = 4  # SDE on every step but the last: W = 3 log-probs per row


@pytest.fixture(scope="module")
def model():
    return load_flow_model()


@pytest.fixture(scope="module")
def manager(model):
    manager = AgentLoopManager.create(small_config(resolution=32, steps=STEPS, num_workers=2), model)
    yield manager
    manager.shutdown()


def test_four_prompts_times_four_give_the_contract_batch(manager, model):
    batch = prompt_batch(4)
    out = manager.generate_sequences(batch)

    # 1. Exactly the contract's keys, with its shapes.
    assert len(out) == 16
    assert set(out.tensors.keys()) == CONTRACT_TENSORS
    assert set(out.non_tensors) == CONTRACT_NON_TENSORS
    w, length, dim = STEPS - 1, model.max_sequence_length, 128
    expected = {
        "prompts": (16, length), "attention_mask": (16, length), "responses": (16, 3, 32, 32),
        "rollout_log_probs": (16, w), "all_latents": (16, w + 1, 3, 32, 32), "all_timesteps": (16, w),
        "all_next_timesteps": (16, w), "prompt_embeds": (16, length, dim), "prompt_embeds_mask": (16, length),
        "rm_scores": (16, 1),
    }
    assert {k: tuple(out[k].shape) for k in expected} == expected
    assert torch.isfinite(out["rollout_log_probs"]).all()

    # 2. Row order preserved: prompts, uids and the left-padded ids all line up with the input.
    assert list(out["raw_prompt"]) == list(batch["raw_prompt"])
    assert list(out["uid"]) == list(batch["uid"])
    for i, prompt in enumerate(batch["raw_prompt"]):
        ids = encode_chat(model.tokenizer, chat_messages(prompt))
        assert torch.equal(out["prompts"][i, length - len(ids):], ids)
        assert out["attention_mask"][i].tolist() == [0] * (length - len(ids)) + [1] * len(ids)

    # 3. rm_scores are the verifier's scores of the returned images; extra info is its verdict.
    verdicts = [shapes.verify(out["responses"][i], out["raw_prompt"][i]) for i in range(16)]
    assert out["rm_scores"][:, 0].tolist() == [v.score for v in verdicts]
    assert list(out["correct"]) == [v.correct for v in verdicts]
    assert list(out["constraints"]) == [v.details["constraints"] for v in verdicts]
    assert list(out["reward_error"]) == [None] * 16
    assert 0 < out["rm_scores"].sum() < 16  # a trained model: a real mix, not a vacuous comparison
    assert out.meta_info["reward_extra_keys"] == SHAPES_EXTRA_KEYS

    # 4. Turns and per-row metrics.
    assert list(out["__num_turns__"]) == [2] * 16
    assert len(out.meta_info["metrics"]) == 16
    for row in out.meta_info["metrics"]:
        assert row["generate_time"] > 0 and row["reward_time"] > 0 and 0 <= row["queue_time"] <= row["generate_time"]
    timing = out.meta_info["timing"]
    assert timing["agent_loop/generate_sequences"] >= timing["agent_loop/worker_max"] >= timing["agent_loop/worker_min"] > 0
    assert out.meta_info["reward_dropped_rows"] == 0

    # 5. Every row has its own seed: the four samples of one prompt differ.
    assert len({out["responses"][i].sum().item() for i in range(4)}) == 4


def test_training_samples_depend_on_the_step_only(manager):
    first, again = manager.generate_sequences(prompt_batch(1)), manager.generate_sequences(prompt_batch(1))
    other_step = manager.generate_sequences(prompt_batch(1, global_steps=2))
    assert torch.equal(first["responses"], again["responses"])
    assert not torch.equal(first["responses"], other_step["responses"])


def test_validation_is_deterministic_ode_without_log_probs(manager):
    batch = prompt_batch(2, validate=True)
    del batch.meta_info["global_steps"]  # validation needs no step
    a, b = manager.generate_sequences(batch), manager.generate_sequences(batch)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["rm_scores"], b["rm_scores"])
    assert "rollout_log_probs" not in a and "all_latents" not in a
    assert not torch.equal(a["responses"][0], a["responses"][1])  # fixed seeds, still one per row


def test_missing_ray_names_the_extra(monkeypatch, model):
    monkeypatch.setitem(sys.modules, "ray", None)  # ray absent, for real, for this import
    with pytest.raises(ImportError, match=r"Ray mode.*pip install 'flowloop\[ray\]'"):
        AgentLoopManager.create(small_config(), model, mode="ray")


def test_unknown_mode_is_rejected(model):
    with pytest.raises(ValueError, match=r"mode must be one of \['local', 'ray'\]"):
        AgentLoopManager.create(small_config(), model, mode="slurm")


def test_a_batch_in_flight_keeps_its_weights_through_an_update_and_shutdown_cancels_one(model):
    manager = AgentLoopManager.create(small_config(), model)
    servers = [h for h in manager.owned if isinstance(h, RolloutServer)]
    try:
        manager.update_weights(servers, None, 0)
        future = manager.generate_sequences_future(prompt_batch(2, weight_version=0))  # returns at once
        manager.update_weights(servers, None, 1)  # waits for the batch in flight: it samples version 0 throughout
        assert future.done() and future.result()["weight_version"].tolist() == [0] * len(future.result())
        out = manager.generate_sequences(prompt_batch(2, weight_version=1))
        assert out["weight_version"].tolist() == [1] * len(out)
        pending = manager.generate_sequences_future(prompt_batch(2, weight_version=1))
    finally:
        manager.shutdown()
    assert pending.cancelled() or pending.done()  # nothing left running on the closed loop

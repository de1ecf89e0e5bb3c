"""Ray mode: the same classes as real Ray actors on a local cluster give local mode's outputs."""

from __future__ import annotations

import pytest
import ray

from flowloop.agent_loop import AgentLoopManager
from flowloop.agent_loop.actors import is_remote
from flowloop.config.rollout import AgentConfig, ServerConfig
from flowloop.models import load_flow_model
from tests.agent_loop.helpers import CONTRACT_NON_TENSORS, CONTRACT_TENSORS, EXAMPLE_YAML, prompt_batch, small_config


@pytest.fixture(scope="module")
def managers():
    """(local, ray) managers over the same weights and config; one Ray session for the module."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    model = load_flow_model()
    config = small_config(resolution=32, steps=4, agent=AgentConfig(num_workers=2, agent_loop_config_path=str(EXAMPLE_YAML)))
    # The engine's matmuls round differently at some batch sizes (3 vs 13 rows: ~2e-5 after 4
    # steps), so both modes must batch the same rows: each worker flushes its own rows as one batch
    # (`RolloutServer.flush`), and neither a full batch nor the (one-minute) clock starts one first.
    config.server = ServerConfig(max_batch_size=64, max_wait_ms=60_000.0)
    local = AgentLoopManager.create(config, model)
    remote = AgentLoopManager.create(config, model, mode="ray")
    yield local, remote
    remote.shutdown()
    local.shutdown()
    ray.shutdown()


def max_abs_diff(a, b) -> float:
    assert set(a.keys()) == set(b.keys())
    diffs = [0.0]
    for key in a.tensors.keys():
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        diffs.append((a[key].double() - b[key].double()).abs().max().item())
    for key in a.non_tensors:
        assert list(a[key]) == list(b[key]), key
    return max(diffs)


def test_ray_actors_give_local_outputs(managers):
    local, remote = managers
    assert all(is_remote(w) for w in remote.workers) and all(is_remote(h) for h in remote.owned)
    train, val = prompt_batch(4), prompt_batch(2, validate=True)
    mixed = prompt_batch(2)
    mixed["agent_name"] = ["single_turn", "retry_until_correct"] * 4  # a YAML-registered loop inside actors
    for batch in (train, val, mixed):
        a, b = local.generate_sequences(batch), remote.generate_sequences(batch)
        d = max_abs_diff(a, b)
        print(f"local vs ray, {len(batch)} rows, validate={batch.meta_info.get('validate', False)}: max |d| = {d:.3g}")
        assert d == 0.0  # bitwise: a row's sample does not depend on the batch it ran in
    out = remote.generate_sequences(train)
    assert set(out.tensors.keys()) == CONTRACT_TENSORS and set(out.non_tensors) == CONTRACT_NON_TENSORS
    assert out["rollout_log_probs"].shape == (16, 3) and list(out["raw_prompt"]) == list(train["raw_prompt"])
    assert len(out.meta_info["metrics"]) == 16 and out.meta_info["metrics"][0]["generate_time"] > 0

"""Scale-out on a local Ray cluster (CPU, gloo): two FSDP2 trainer ranks compute the one-process
update; replicas sample each update's weights; sharded checkpoints (torch.distributed.checkpoint)
move between world sizes; a killed replica is replaced and the step completes."""

from __future__ import annotations

import copy
import json

import pytest
import ray
import torch
from safetensors.torch import load_file

from flowloop.agent_loop import AgentLoopManager
from flowloop.models import load_flow_model, load_trained_weights
from flowloop.models.trained import read_trained_weights
from flowloop.protocol import Batch
from flowloop.trainer.advantages import compute_advantages
from flowloop.trainer.checkpoint import (
    checkpoint_problem, describe_weights, latest_valid_checkpoint, load_checkpoint, save_checkpoint,
)
from flowloop.trainer.export import export
from flowloop.trainer.placement import WorkerGroup
from flowloop.trainer.recipe import run, train_state
from tests.trainer.test_recipe import tiny_config  # noqa: F401  (registers the test_brightness reward)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def scored_batch(cfg) -> tuple[Batch, torch.Tensor]:
    """One real training batch of the run ``cfg`` describes, sampled and scored locally, and its
    group advantages."""
    local = changed(cfg, scale={"mode": "local", "world_size": 1})
    group = WorkerGroup.create(local)
    manager = AgentLoopManager.create(local.rollout, group.local_worker.model, replicas=group.replicas)
    try:
        prompts = ["a red circle", "two blue squares"]
        n = cfg.rollout.n
        batch = Batch.from_dict(non_tensors={"raw_prompt": [p for p in prompts for _ in range(n)],
                                             "uid": [str(i) for i in range(len(prompts)) for _ in range(n)]},
                                meta_info={"global_steps": 1})
        out = manager.generate_sequences(batch)
    finally:
        manager.shutdown()
        group.shutdown()
    result = compute_advantages("grpo", out["rm_scores"][:, 0], out["uid"])
    return out, result.advantages


def changed(cfg, **sections):
    """A copy of ``cfg`` with ``section={field: value}`` changes, validated."""
    new = copy.deepcopy(cfg)
    for section, fields in sections.items():
        for key, value in fields.items():
            setattr(getattr(new, section), key, value)
    new.validate()
    return new


def two_updates(cfg, batch, advantages):
    """Metrics of two updates on ``batch`` and the trained weights after them."""
    group = WorkerGroup.create(cfg)
    try:
        generator = torch.Generator().manual_seed(0)
        metrics = [group.update(batch, advantages, generator) for _ in range(2)]
        weights = group.call_all(group.actors, "trainable_state", True)[0]
    finally:
        group.shutdown()
    return metrics, weights


@pytest.mark.parametrize("finetune, objective, micro, epochs", [
    ("full", "flow_grpo", 4, 2), ("lora", "nft", 4, 2), ("full", "nft", 7, 2), ("full", "flow_grpo", 2, 1)])
def test_two_fsdp_ranks_compute_the_single_process_update(cluster, tiny_model_dir, tmp_path, finetune, objective, micro,
                                                         epochs):
    """``micro=7`` on 8 rows leaves a last micro-batch of 1 row for 2 ranks: the rank with no row
    of its own still joins the collectives, at weight 0, and the update is the one-process one.
    FlowGRPO replays its old log-probs (skip_old_logprob=false): with one epoch each rank passes
    only its own rows, with two every row."""
    cfg = tiny_config(tiny_model_dir, tmp_path, f"actor.finetune={finetune}", f"actor.objective={objective}",
                      f"actor.micro_batch_size={micro}", f"actor.mini_batch_size={micro}", f"actor.inner_epochs={epochs}",
                      "actor.flow_grpo.skip_old_logprob=false")
    batch, advantages = scored_batch(cfg)
    single_metrics, single = two_updates(cfg, batch, advantages)
    sharded_metrics, sharded = two_updates(changed(cfg, scale={"mode": "ray", "world_size": 2}), batch, advantages)
    assert single.keys() == sharded.keys() and len(single) > 0
    for name in single:  # relative to the weight's norm: float summation order is all that differs
        gap = torch.linalg.vector_norm(single[name] - sharded[name]) / torch.linalg.vector_norm(single[name]).clamp_min(1e-12)
        assert gap <= 1e-6, (name, float(gap))
    for one, two in zip(single_metrics, sharded_metrics):
        assert one.keys() == two.keys()
        for key in (k for k in one if not k.startswith("time/")):  # wall times differ, the math must not
            assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-6), key  # float32 sums in another order


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ray_run_with_two_ranks_two_replicas_two_reward_workers_trains_on_policy(cluster, tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path, "actor.objective=flow_grpo", "trainer.total_steps=3", "trainer.val_every=3",
                      "scale.mode=ray", "scale.world_size=2", "scale.placement=disaggregated", "scale.rollout_replicas=2",
                      "rollout.reward.num_workers=2", "rollout.reward.name=jpeg_compressibility")
    run(cfg, log=lambda _: None)
    trained = [r for r in metrics_rows(tmp_path / "shapes") if "actor/grad_norm" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    for row in trained:
        # The replicas sampled with the weights the trainer replays: log-probs agree.
        assert row["rollout_correction/max"] <= 1e-6
        assert row["rollout/weight_version"] == row["step"] - 1


def shard_files(checkpoint):
    return sorted(p.name for p in (checkpoint / "dcp").iterdir())


def two_rank_run(model_dir, tmp_path):
    """Two steps of a 2-rank run (full fine-tune), checkpointed at step 2."""
    two = tiny_config(model_dir, tmp_path, "trainer.total_steps=2", "trainer.save_every=2",
                      "scale.mode=ray", "scale.world_size=2", "rollout.reward.name=jpeg_compressibility")
    run(two, log=lambda _: None)
    return two, tmp_path / "shapes" / "checkpoints" / "step_000002"


def assert_steps_continue(run_dir, last):
    steps = [r["step"] for r in metrics_rows(run_dir)]
    assert steps == sorted(steps) and steps[-1] == last and steps.count(last) == 1 and steps.count(last - 1) == 1


def test_a_two_rank_checkpoint_is_sharded_and_resumes_on_one_rank(cluster, tiny_model_dir, tmp_path):
    two, saved = two_rank_run(tiny_model_dir, tmp_path)
    # 1. Written in shards by the two ranks: no whole-model file, and the manifest covers the shards.
    assert shard_files(saved) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (saved / "model.safetensors").exists() and not (saved / "optimizer.pt").exists()
    listed = json.loads((saved / "manifest.json").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "state.pt", "schedulers.pt"} <= set(listed)
    weights = read_trained_weights(saved)  # joined in this process, without a process group
    # 2. Loaded by one rank: the weights the two ranks saved.
    one = changed(two, scale={"world_size": 1}, trainer={"total_steps": 3, "resume": "auto"})
    group = WorkerGroup.create(one)
    try:
        group.load_checkpoint_state(train_state(load_checkpoint(saved)))
        after = group.call_all(group.actors, "trainable_state", True)[0]
    finally:
        group.shutdown()
    _assert_equal(after, weights)
    # 3. The resumed run continues the metrics log where it stopped.
    run(one, log=lambda _: None)
    assert_steps_continue(tmp_path / "shapes", 3)


def test_a_two_rank_checkpoint_resumes_on_two_ranks(cluster, tiny_model_dir, tmp_path):
    two, saved = two_rank_run(tiny_model_dir, tmp_path)
    run(changed(two, trainer={"total_steps": 3, "resume": "auto"}), log=lambda _: None)
    assert_steps_continue(tmp_path / "shapes", 3)
    assert shard_files(saved.parent / "step_000003") == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def sharded_lora_checkpoint(model_dir, tmp_path):
    """A 2-rank LoRA trainer after one update writes its shards; returns the run's config, the
    checkpoint and the state the ranks held (gathered)."""
    cfg = tiny_config(model_dir, tmp_path, "actor.finetune=lora", "actor.objective=nft", "scale.mode=ray",
                      "scale.world_size=2", "rollout.reward.name=jpeg_compressibility")
    batch, advantages = scored_batch(cfg)
    group = WorkerGroup.create(cfg)
    try:
        group.update(batch, advantages, torch.Generator().manual_seed(0))
        expected = group.checkpoint_state()  # gathered on rank 0
        saved = save_checkpoint(tmp_path / "run", 1, None, schedulers=[expected["scheduler"]],
                                description=describe_weights(cfg.model, cfg.actor), shards=group.save_shards)
    finally:
        group.shutdown()
    return cfg, saved, expected


def assert_loads_on(world_size, cfg, saved, expected):
    """``world_size`` fresh ranks load the adapters and optimizer state the saving ranks held."""
    fresh = WorkerGroup.create(changed(cfg, scale={"world_size": world_size}))
    try:
        fresh.load_checkpoint_state(train_state(load_checkpoint(saved)))
        loaded = fresh.checkpoint_state()
    finally:
        fresh.shutdown()
    _assert_equal(loaded["model"], expected["model"])
    _assert_equal(loaded["optimizer"]["state"], expected["optimizer"]["state"])
    assert loaded["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]


def test_sharded_lora_checkpoint_loads_on_any_world_size_exports_and_is_verified(cluster, tiny_model_dir, tmp_path):
    """1 and 2 fresh ranks load what 2 ranks saved (bit for bit, with the optimizer state); export
    and ``--checkpoint`` give the gathered adapters; a changed shard fails the manifest."""
    cfg, saved, expected = sharded_lora_checkpoint(tiny_model_dir, tmp_path)
    assert shard_files(saved) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all("lora_" in name for name in expected["model"])  # the frozen base weights are not written
    # 1. One process reads the adapters (no process group); 1 and 2 fresh ranks load them.
    _assert_equal(read_trained_weights(saved), expected["model"])
    for world_size in (1, 2):
        assert_loads_on(world_size, cfg, saved, expected)
    # 2. The export's adapters are the gathered ones (peft's names: no adapter name inside).
    written = export(saved, tmp_path / "export")
    adapters = load_file(str(written["peft"] / "adapter_model.safetensors"))
    assert len(adapters) == len(expected["model"])
    for name, value in expected["model"].items():
        assert torch.equal(adapters["base_model.model." + name.replace(".default.weight", ".weight")], value), name
    # 3. `--checkpoint` (eval, generate) puts the same adapters into a freshly loaded model.
    model = load_trained_weights(load_flow_model(tiny_model_dir), saved)
    _assert_equal({k: v for k, v in model.trainable_module().state_dict().items() if "lora_" in k}, expected["model"])
    # 4. A changed byte in one rank's shard: the checkpoint is refused, by name.
    shard = saved / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_problem(saved) == "dcp/__1_0.distcp does not match its sha256 in the manifest"
    assert latest_valid_checkpoint(tmp_path / "run") is None
    with pytest.raises(ValueError, match="__1_0.distcp does not match"):
        load_checkpoint(saved)


@pytest.mark.slow
def test_a_two_rank_sharded_checkpoint_loads_on_four_ranks(cluster, tiny_model_dir, tmp_path):
    """Four fresh ranks reshard what two saved, bit for bit (about a minute on two CPU cores)."""
    assert_loads_on(4, *sharded_lora_checkpoint(tiny_model_dir, tmp_path))


def _assert_equal(got, expected):
    """Nested dicts of tensors (and plain values) equal, bit for bit."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_equal(got[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_a_killed_replica_restarts_and_the_step_completes(cluster, tiny_model_dir, tmp_path):
    """Kill one of two disaggregated replicas mid-step: its requests go to the other (counted in
    ``agent_loop/retries``), Ray restarts it, and after the next weight sync it samples again."""
    import threading

    cfg = tiny_config(tiny_model_dir, tmp_path, "scale.mode=ray", "scale.placement=disaggregated", "scale.rollout_replicas=2",
                      "rollout.reward.name=jpeg_compressibility", "rollout.server.max_batch_size=2", "rollout.server.max_wait_ms=1")
    group = WorkerGroup.create(cfg)
    manager = AgentLoopManager.create(cfg.rollout, type("Info", (), group.describe()), mode="ray", replicas=group.replicas)
    try:
        group.sync_weights(manager, 0)
        prompts = ["a red circle", "two blue squares", "a green triangle", "three red squares"] * 4
        batch = Batch.from_dict(non_tensors={"raw_prompt": prompts, "uid": [str(i) for i in range(len(prompts))]},
                                meta_info={"global_steps": 1, "weight_version": 0})
        ray.get(group.replicas[0].pause.remote())  # its requests wait in its queue until the kill
        killer = threading.Timer(2.0, lambda: ray.kill(group.replicas[0], no_restart=False))
        killer.start()
        out = manager.generate_sequences(batch)
        killer.join()
        assert len(out) == len(prompts) and not torch.isnan(out["rm_scores"]).any()
        assert out.meta_info["timing"]["agent_loop/retries"] >= 1
        assert set(out["weight_version"].tolist()) == {0}
        group.sync_weights(manager, 1)  # reaches the restarted replica too
        again = manager.generate_sequences(Batch.from_dict(non_tensors=dict(batch.non_tensors),
                                                           meta_info={"global_steps": 2, "weight_version": 1}))
        assert set(again["weight_version"].tolist()) == {1} and again.meta_info["timing"]["agent_loop/retries"] == 0
    finally:
        manager.shutdown()
        group.shutdown()


def test_colocated_ranks_keep_their_rows_and_the_update_replays_them(cluster, tiny_model_dir, tmp_path):
    """Colocated, a row's embeddings and latents stay in the rank that sampled them: the driver's
    batch names them (``held_row``) and carries only the small columns; the update on 2 ranks
    gathers them back and replays the rollout's log-probs exactly; a batch naming rows no rank
    holds any more is refused with the reason."""
    cfg = tiny_config(tiny_model_dir, tmp_path, "actor.objective=flow_grpo", "scale.mode=ray", "scale.world_size=2",
                      "scale.placement=colocated", "rollout.reward.name=jpeg_compressibility")
    group = WorkerGroup.create(cfg)
    manager = AgentLoopManager.create(cfg.rollout, type("Info", (), group.describe()), mode="ray", replicas=group.replicas)
    try:
        prompts = ["a red circle", "two blue squares"]
        n = cfg.rollout.n
        batch = Batch.from_dict(non_tensors={"raw_prompt": [p for p in prompts for _ in range(n)],
                                             "uid": [str(i) for i in range(len(prompts)) for _ in range(n)]},
                                meta_info={"global_steps": 1, "weight_version": 0})
        manager.update_weights(group.replicas, None, 0)
        out = manager.generate_sequences(batch)
        assert "held_row" in out and "weight_version" in out and "rollout_log_probs" in out
        assert not {"all_latents", "final_latents", "prompt_embeds"} & set(out.keys())
        held = [m["held_rows"] for m in group.call_all(group.actors, "metrics")]
        assert sum(held) == len(out) and min(held) > 0  # both ranks sampled some rows
        advantages = compute_advantages("grpo", out["rm_scores"][:, 0], out["uid"]).advantages
        metrics = group.update(out, advantages, torch.Generator().manual_seed(0))
        assert metrics["rollout_correction/max"] <= 1e-6
        assert [m["held_rows"] for m in group.call_all(group.actors, "metrics")] == [0.0, 0.0]
        with pytest.raises(Exception, match="name rollout tensors no rank holds"):
            group.update(out, advantages, torch.Generator().manual_seed(0))
        # Rows no update takes (a step whose groups were all dropped) go once the next weights load.
        manager.generate_sequences(batch)
        assert sum(m["held_rows"] for m in group.call_all(group.actors, "metrics")) == len(out)
        manager.update_weights(group.replicas, None, 1)
        assert [m["held_rows"] for m in group.call_all(group.actors, "metrics")] == [0.0, 0.0]
    finally:
        manager.shutdown()
        group.shutdown()

"""`flowloop bench` on a tiny model on the CPU: every figure is there and consistent."""

import json

import torch
from torch import nn

from flowloop.cli import main
from flowloop.trainer.bench import count_flops


def test_bench_reports_the_ceiling_rollout_update_and_step(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    try:
        code = main(["bench", "--recipe", "shapes_flow_grpo", "--steps", "1", "--json", str(out), f"model.path={tiny_model_dir}",
                     "rollout.pipeline.height=16", "rollout.pipeline.width=16", "rollout.pipeline.num_inference_steps=4",
                     "rollout.algo.sde_window_size=2", "rollout.algo.sde_window_range=[0,3]", "data.prompts_per_step=2",
                     "rollout.n=4", "actor.micro_batch_size=4", "actor.mini_batch_size=8", "rollout.reward.name=jpeg_compressibility",
                     "model.cudnn_attention=false"])
        assert code == 0
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # model.cudnn_attention=false turns the kernel off process-wide
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    figures = json.loads(out.read_text())
    assert figures["rows"] == 8 and figures["steps_timed"] == 1 and figures["matmul_tflops"] > 0
    for part in ("ceiling", "rollout", "update", "step"):
        assert figures[part]["seconds"] > 0 and figures[part]["tflops"] > 0 and figures[part]["mfu"] > 0, part
    # A step holds its rollout and its update; the rollout does what the bare forward loop does, and more.
    assert figures["step"]["seconds"] >= figures["rollout"]["seconds"] + figures["update"]["seconds"] * 0.99
    assert figures["rollout"]["images_per_s"] == figures["rows"] / figures["rollout"]["seconds"]
    assert 0 < figures["rollout"]["of_ceiling"] < 2
    # The engine's phases split its time: each ran, and together they are most of the engine's
    # seconds (the rest: validating requests, switching the module to eval mode and back).
    phases = figures["rollout"]["engine_phase_seconds"]
    assert set(phases) == {"prompts", "denoise", "decode", "outputs"} and min(phases.values()) > 0
    assert 0.5 * figures["rollout"]["engine_seconds"] < sum(phases.values()) <= figures["rollout"]["engine_seconds"]
    assert figures["rollout_vs_replay_logprob_gap"] <= 1e-5  # float32 on the CPU: replay reproduces the rollout
    assert 0 <= figures["rollout_vs_replay_logprob_gap_mean"] <= figures["rollout_vs_replay_logprob_gap"]
    # The slowest row's reward wait: part of the rollout, and not inside the engine.
    assert 0 < figures["rollout"]["slowest_reward_seconds"] < figures["rollout"]["seconds"]


def test_bench_in_ray_mode_is_refused_naming_the_setting(tiny_model_dir, capsys):
    code = main(["bench", "--steps", "1", f"model.path={tiny_model_dir}", "scale.mode=ray"])
    assert code != 0
    assert "scale.mode='ray'" in capsys.readouterr().err


def test_the_ceiling_runs_in_the_rollout_servers_batches(tiny_model):
    from flowloop.config import load_config
    from flowloop.config.train import TrainConfig
    from flowloop.protocol import Batch
    from flowloop.trainer.bench import bare_forward

    cfg = load_config(TrainConfig, ["rollout.server.max_batch_size=3", "rollout.pipeline.num_inference_steps=2"])
    ids = tiny_model.tokenizer(["a red circle"] * 8, padding="max_length", max_length=8, return_tensors="pt")
    embeds = tiny_model.encode_prompt(ids["input_ids"], ids["attention_mask"])
    out = Batch.from_dict({"final_latents": torch.randn(8, *tiny_model.latent_shape(4, 4)), **embeds})
    rows = []
    hook = tiny_model.trainable_module().register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    try:
        seconds, flops = bare_forward(tiny_model, out, cfg, torch.device("cpu"), repeats=1)
    finally:
        hook.remove()
    assert seconds > 0 and flops > 0
    assert rows == [3, 3, 2] * (1 + 1 + 2)  # FLOPs counted, warm-up, then one timed loop of 2 steps


class _Block(nn.Module):
    """A linear layer that records whether its last call ran inside compiled code."""

    def __init__(self):
        super().__init__()
        self.linear, self.compiled = nn.Linear(8, 8), None

    def forward(self, x):
        self.compiled = torch.compiler.is_compiling()
        return self.linear(x)


def test_counting_flops_sees_every_op_and_leaves_compiled_code_compiled():
    torch._dynamo.reset()
    block, x = _Block(), torch.randn(4, 8)
    block.compile(backend="eager")
    with torch.no_grad():
        block(x)
        assert block.compiled
        assert count_flops(lambda: block(x)) == 2 * 4 * 8 * 8  # the matmul, seen by the counter: run eager
        assert block.compiled is False
        block(x)
    assert block.compiled  # a plain FlopCounterMode here leaves the block eager from then on

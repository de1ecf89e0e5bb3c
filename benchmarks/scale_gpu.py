"""Does the scale-out path cost anything when one GPU is all there is? Whole RL steps of a real-size
family (random weights, the family's recipe: LoRA, CFG), through the trainer's own calls, in
local mode and through Ray with one colocated rank, measured one after the other in one run.

    python benchmarks/scale_gpu.py --families sd3 qwen_image --steps 3 --out /tmp/scale_gpu.json   # one H200

Per family and mode: the model is built in memory on the GPU (`benchmarks/real_models.py`'s
published configs; inside the Ray actor in Ray mode), then ``--steps`` timed RL steps after one
warm-up step, each: the `AgentLoopManager` samples and scores ``prompts x n`` images
(jpeg_compressibility: a CPU reward with no weights to load), advantages, `WorkerGroup.update`
(one optimizer step, gradient checkpointing, micro-batches of ``--micro-batch``), then
`WorkerGroup.sync_weights`. Figures: images/s of the whole step and of the rollout alone, update
and weight-sync seconds, the engine's own sampling time and the update's own compute time (the rest
is moving rows between processes), and the rollout-correction max (replay vs rollout log-prob, bf16).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

def build_family(family: str, options: dict, tiny: bool = False):
    """The family's real-size `FlowModel` with random bf16 weights on this process's GPU (``tiny``:
    the tests' tiny configs in float32 on the CPU, to check this script anywhere)."""
    from benchmarks.real_models import REAL, TINY, build_model

    torch.manual_seed(0)
    return build_model(family, TINY if tiny else REAL, options, "cpu" if tiny else "cuda", torch.float32 if tiny else torch.bfloat16)


def make_config(family: str, args, mode: str):
    from flowloop.config import load_config
    from flowloop.config.train import TrainConfig

    recipe = ROOT / "flowloop" / "config" / "recipes" / f"{family}.yaml"
    rows = args.prompts * args.n
    size = 64 if args.tiny else 512
    device = ["model.device=cpu", "model.dtype=float32"] if args.tiny else ["model.device=cuda", "model.dtype=bfloat16"]
    cfg = load_config(TrainConfig, [
        *device, "model.gradient_checkpointing=true",
        f"rollout.n={args.n}", f"data.prompts_per_step={args.prompts}",
        f"rollout.pipeline.height={size}", f"rollout.pipeline.width={size}", "rollout.pipeline.num_inference_steps=10",
        "rollout.algo.sde_window_size=2", "rollout.algo.sde_window_range=[0,5]",
        f"actor.micro_batch_size={args.micro_batch}", f"actor.mini_batch_size={rows}",
        f"rollout.server.max_batch_size={rows}", f"rollout.server.max_wait_ms={args.max_wait_ms}", "rollout.reward.name=jpeg_compressibility",
        f"scale.mode={mode}", f"scale.gpus_per_node={1 if mode == 'ray' and not args.tiny else 0}",
    ], [recipe])
    cfg.rollout.reward.kwargs = {}  # the recipe's reward model path belongs to its own reward
    return cfg


def run_mode(family: str, args, mode: str) -> dict:
    from flowloop.agent_loop import AgentLoopManager
    from flowloop.trainer.bench import rl_steps
    from flowloop.trainer.placement import WorkerGroup

    cfg = make_config(family, args, mode)
    build = functools.partial(build_family, family, dict(cfg.model.options), args.tiny)
    start = time.perf_counter()
    group = WorkerGroup.create(cfg, build)
    local = group.local_worker
    info = local.model if local is not None else type("Info", (), group.describe())
    manager = AgentLoopManager.create(cfg.rollout, info, mode=mode, replicas=group.replicas)
    result = {"family": family, "mode": mode, "setup_s": time.perf_counter() - start}
    try:
        result["steps"], _ = rl_steps(group, manager, cfg, args.steps + 1,
                                      log=lambda line: print(f"{family} {mode} {line}", flush=True))
        result["mean_engine_batch"] = group.call_all(group.replicas, "metrics")[0].get("mean_batch_size")
    finally:
        manager.shutdown()
        group.shutdown()
        del group, manager, info, local
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    timed = result["steps"][1:]  # the first step pays one-off costs
    rows = args.prompts * args.n

    def mean(key):
        return statistics.mean(s[key] for s in timed)

    result.update(images_per_s=rows / mean("step_s"), rollout_images_per_s=rows / mean("rollout_s"),
                  update_s=mean("update_s"), sync_s=mean("sync_s"), update_compute_s=mean("update_compute_s"),
                  engine_s=mean("engine_s"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["sd3", "qwen_image"])
    parser.add_argument("--modes", nargs="+", default=["ray", "local"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the modes this many times, the order reversed every other round (ray, local, local, "
                             "ray...): a GPU that runs slower or faster as a session goes on then weighs on both modes alike")
    parser.add_argument("--steps", type=int, default=3, help="timed RL steps (after one warm-up step)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=8, help="group size")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--max-wait-ms", type=float, default=250.0, help="rollout.server.max_wait_ms (the default)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny configs on the CPU (checks the script)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    results = []
    for family in args.families:
        for round_index, mode in ((r, m) for r in range(args.rounds) for m in (args.modes if r % 2 == 0 else args.modes[::-1])):
            try:
                results.append({**run_mode(family, args, mode), "round": round_index})
            except Exception as err:  # one failure keeps the others' figures
                results.append({"family": family, "mode": mode, "round": round_index, "error": repr(err)})
                print(f"{family} {mode} failed: {err!r}", flush=True)
            if args.out:
                device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
                Path(args.out).write_text(json.dumps({"device": device, "results": results}, indent=2))
    print(f"\n{'family':12} {'mode':6} {'round':>5} {'img/s step':>10} {'img/s rollout':>13} {'engine_s':>8} {'update_s':>9} "
          f"{'compute_s':>9} {'sync_s':>7} {'batch':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['family']:12} {r['mode']:6} {r['round']:5} {r['error'][:80]}")
        else:
            print(f"{r['family']:12} {r['mode']:6} {r['round']:5} {r['images_per_s']:10.3f} {r['rollout_images_per_s']:13.3f} "
                  f"{r['engine_s']:8.2f} {r['update_s']:9.2f} {r['update_compute_s']:9.2f} {r['sync_s']:7.3f} "
                  f"{r['mean_engine_batch'] or 0:6.1f}")


if __name__ == "__main__":
    main()

"""Where a rollout's time outside the denoising loop goes, on a real-size model with random weights.

    python benchmarks/rollout_breakdown.py --family sd3 --n 16

Runs `flowloop bench`'s RL steps (the same settings as benchmarks/gpu_levers.py: 512x512, 10 steps,
SDE window 2, one prompt x ``--n``, the family's recipe) with wall-clock timers around the host-side
parts of a rollout (prompt encoding and noise, the host copies, the reward call, the JPEG encode,
the agent loop's stacking), then profiles one more rollout's batch with torch's profiler. Prints each part's
seconds in the last step and writes the profiler's tables (host time and device time per op) to
``OUT/profile.txt``. The timers synchronize the device, so the step itself is slower than
`flowloop bench`'s; read the parts, not the total.
"""

from __future__ import annotations

import argparse
import collections
import functools
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_levers import FAMILIES, shared_overrides  # noqa: E402

SECONDS: dict[str, list[float]] = collections.defaultdict(list)


def _timed(owner, name: str, label: str, device: torch.device | None = None) -> None:
    """Replace ``owner.name`` by a wrapper that appends each call's seconds to ``SECONDS[label]``:
    with ``device``, a function whose device work is timed too (synchronized around it); without,
    a coroutine (on the event loop, which must not block on the device)."""
    from flowloop.trainer.bench import timed

    inner = getattr(owner, name)
    if device is None:
        @functools.wraps(inner)
        async def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                SECONDS[label].append(time.perf_counter() - start)
    else:
        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            with timed(device, SECONDS[label]):
                return inner(*args, **kwargs)
    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--extra", default="", help="more overrides")
    args = parser.parse_args()

    from flowloop.agent_loop import AgentLoopManager
    from flowloop.agent_loop.worker import AgentLoopWorker
    from flowloop.cli import recipe_path
    from flowloop.config import load_config
    from flowloop.config.train import TrainConfig
    from flowloop.reward import compression
    from flowloop.reward.worker import RewardWorker
    from flowloop.rollout import engine
    from flowloop.trainer import bench
    from flowloop.trainer.placement import WorkerGroup

    overrides = shlex.split(shared_overrides(args.n, args.micro_batch, args.extra))
    cfg = load_config(TrainConfig, overrides, [recipe_path(args.family)])
    group = WorkerGroup.create(cfg, bench.random_model_builder(args.family, cfg))
    manager = AgentLoopManager.create(cfg.rollout, group.local_worker.model, replicas=group.replicas)
    try:
        bench.rl_steps(group, manager, cfg, 2)  # compiles, warms up
        device = torch.device(cfg.model.device)
        _timed(engine.RolloutEngine, "_encode", "prompt encoding (engine._encode)", device)
        _timed(engine, "randn_per_sample", "noise (randn_per_sample, every call)", device)
        _timed(type(group.local_worker.model), "encode_prompt", "text encoders (model.encode_prompt)", device)
        _timed(engine, "_outputs", "host copies (engine._outputs)", device)
        _timed(engine.RolloutEngine, "sample", "engine.sample", device)
        _timed(RewardWorker, "_call", "reward call (stack + reward fn)")
        _timed(compression, "jpeg_sizes_kb", "JPEG sizes (reward fn)", device)
        _timed(AgentLoopWorker, "_postprocess", "agent loop stacking (_postprocess)", device)
        _timed(AgentLoopWorker, "generate_sequences", "agent loop worker, whole call")
        rows, _ = bench.rl_steps(group, manager, cfg, 1)
        print(f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, {args.family}, "
              f"{args.n} samples; timed step (device synchronized around each part):")
        for key in ("rollout_s", "engine_s", "prompts_s", "denoise_s", "decode_s", "outputs_s", "reward_max_s"):
            print(f"  {key:<42} {rows[-1][key]:.4f} s")
        for label, values in SECONDS.items():
            print(f"  {label:<42} {sum(values):.4f} s over {len(values)} call(s)")
    finally:
        manager.shutdown()
        group.shutdown()


if __name__ == "__main__":
    main()

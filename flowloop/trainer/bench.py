"""`flowloop bench`: where the time of an RL step goes, against what the hardware can do.

In one run, on one device, with a run's own config (its recipe's sampler, CFG, LoRA, sizes):

1. whole RL steps through the trainer's own calls (`rl_steps`: the manager samples and scores,
   advantages, `WorkerGroup.update`, `WorkerGroup.sync_weights`), one warm-up step then the
   timed ones: images/s of a step, of its rollout and its update; the update's
   ``rollout_correction/max`` is the gap between the rollout's and the replay's log-probs; the
   rollout's time split into the engine's phases and the rest (agent loop and reward, with the
   slowest row's wait for its reward);
2. the ceiling: the bare denoiser forward loop at the rollout's rows (``num_inference_steps``
   guided velocities on the step's own latents and embeddings, in batches of the rollout
   server's ``max_batch_size`` samples as the rollout runs them; no sampler, no decode, no
   server), timed the same way;
3. FLOPs counted by torch's ``FlopCounterMode`` on one guided velocity at the rollout's rows
   (the update's estimated from it: `estimated_update_flops`), turned into achieved TFLOP/s,
   and MFU against a dense matmul in the model's dtype measured in the same run;
4. peak device memory.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from flowloop.models.base import is_embedding_key
from flowloop.protocol import Batch
from flowloop.rollout.engine import PHASES, guided_velocity
from flowloop.trainer.advantages import compute_advantages

PROMPTS = ["a red cat sitting on a wooden table", "two dogs playing in the snow at night",
           "a lighthouse on a cliff at sunset", "a bowl of ramen with chopsticks"]
"""Prompts the benchmark samples when the run has no task rows of its own to give."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, out: list):
    """Append the block's wall seconds (device work included) to ``out``."""
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    out.append(time.perf_counter() - start)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 8192, repeats: int = 10) -> float:
    """Dense ``size``-cube matmul TFLOP/s in ``dtype``: the peak MFU is measured against."""
    size = size if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    seconds: list[float] = []
    with timed(device, seconds):
        for _ in range(repeats):
            a @ b
    return 2 * size**3 * repeats / seconds[0] / 1e12


def count_flops(fn) -> int:
    """FLOPs torch's dispatcher sees while ``fn()`` runs (matmuls, convolutions, attention), with
    compiled code run eager so that every op is seen. The eager stance also keeps the compiled
    blocks compiled afterwards: a compiled function called under a dispatch mode with no graph
    for the call makes torch skip compiling its code for good, and the bare forward timed after
    the count then ran eager (SD3.5-Medium's ceiling read 3.68 s against the rollout's 1.78 s)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.compiler.set_stance("force_eager"), counter:
        fn()
    return counter.get_total_flops()


def step_batch(cfg, step: int, weight_version: int, task=None) -> Batch:
    """``prompts_per_step x n`` rows in GRPO groups for training step ``step``: the task's own
    training rows, or (no task) `PROMPTS`."""
    from flowloop.trainer.recipe import group_batch

    count = cfg.data.prompts_per_step
    rows = (task.train_rows(cfg.trainer.seed, step, count) if task is not None
            else [{"raw_prompt": PROMPTS[(step + g) % len(PROMPTS)]} for g in range(count)])
    return group_batch(rows, step, cfg.rollout.n, cfg.data.negative_prompt, weight_version)


def rl_steps(group, manager, cfg, steps: int, log=print, task=None) -> tuple[list[dict], Batch]:
    """``steps`` RL steps through the trainer's own calls; per step its seconds (rollout,
    update, update compute, weight sync, whole step), the engine's own sampling seconds and
    the rollout-correction max; and the last step's batch, with its rollout tensors."""
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    group.sync_weights(manager, 0)
    engine_keys = {"engine_s": "engine_time_s", **{f"{phase}_s": f"engine_{phase}_s" for phase in PHASES}}

    def engine_seconds():
        metrics = group.call_all(group.replicas, "metrics")[0]
        return {name: metrics.get(key, 0.0) for name, key in engine_keys.items()}

    engine_before = engine_seconds()
    rows, out = [], None
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        out = manager.generate_sequences(step_batch(cfg, step, step - 1, task))
        t1 = time.perf_counter()
        held = getattr(group.local_worker, "held", None)
        if step == steps and held is not None:  # the bare forward reads this batch's rollout tensors: restore them here
            out = held.restore(out)
        advantages = compute_advantages(cfg.advantage.estimator, out["rm_scores"][:, 0], out["uid"]).advantages
        metrics = group.update(out, advantages, generator)
        t2 = time.perf_counter()
        group.sync_weights(manager, step)
        t3 = time.perf_counter()
        engine = engine_seconds()
        rows.append({"rollout_s": t1 - t0, "update_s": t2 - t1, "update_compute_s": metrics.get("time/update_compute"),
                     "sync_s": t3 - t2, "step_s": t3 - t0,
                     "reward_max_s": out.meta_info.get("timing", {}).get("agent_loop/reward_time/max"),
                     **{name: engine[name] - engine_before[name] for name in engine_keys},
                     "correction_max": metrics.get("rollout_correction/max"),
                     "correction_mean": metrics.get("rollout_correction/mean")})
        engine_before = engine
        log(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items() if v is not None))
    return rows, out


def bare_forward(model, out: Batch, cfg, device: torch.device, repeats: int = 2) -> tuple[float, int]:
    """Seconds of ``num_inference_steps`` guided velocities on the batch's first recorded latents
    (the best of ``repeats`` after a warm-up), and the FLOPs of one of them over every row. The
    rows go through in batches of ``rollout.server.max_batch_size`` samples, the largest batch the
    rollout's server forms: a bigger one would time a shape the rollout never runs (with Qwen-Image's
    8, its compiled loop beat a ceiling timed on all 16 samples at once)."""
    guidance = cfg.rollout.pipeline.guidance_scale
    steps = cfg.rollout.pipeline.num_inference_steps

    def inputs(part: Batch) -> tuple:
        latents = part["all_latents"][:, 0] if "all_latents" in part else part["final_latents"]
        embeds = {k: part[k].to(device) for k in part.keys() if is_embedding_key(k)}
        return latents.to(device), torch.full((len(part),), 0.5, device=device), embeds

    batches = [inputs(part) for part in out.split(cfg.rollout.server.max_batch_size)]

    def forward():
        for latents, sigma, embeds in batches:
            guided_velocity(model, latents, sigma, embeds, guidance)

    with torch.no_grad():
        flops = count_flops(forward)
        forward()
        seconds: list[float] = []
        for _ in range(repeats):
            with timed(device, seconds):
                for _ in range(steps):
                    forward()
    return min(seconds), flops


def estimated_update_flops(actor, out: Batch, forward_flops: int, cfg) -> int:
    """An update's FLOPs from one guided velocity's counted ones (``forward_flops``, all rows):
    per trained term a forward and a backward (2x), plus a recomputed forward with gradient
    checkpointing and a reference forward with a KL term. Counting the update itself under
    ``FlopCounterMode`` keeps every activation alive and runs a real-size model out of memory."""
    keys = [k for k in actor.objective.rollout_keys if k in out]
    terms = actor.objective.prepare({k: out[k] for k in keys}, torch.Generator().manual_seed(0))
    per_term = 3 + int(cfg.model.gradient_checkpointing) + int(cfg.actor.kl_coef > 0)
    return forward_flops * terms * per_term * cfg.actor.inner_epochs


def run_bench(cfg, build=None, steps: int = 3, log=print) -> dict:
    """Every figure of the module docstring for ``cfg`` (local mode), as a dict. Prompts: the
    run's task rows when its task can be built here (the shapes world, a prompt file that
    exists), else `PROMPTS` (a real-model recipe whose prompt file is elsewhere)."""
    from pathlib import Path

    from flowloop.agent_loop import AgentLoopManager
    from flowloop.tasks import build_task
    from flowloop.trainer.placement import WorkerGroup

    if cfg.scale.mode != "local":
        raise ValueError(f"flowloop bench times one process (the ceiling runs its model in place); got "
                         f"scale.mode={cfg.scale.mode!r}: leave scale.* at its defaults, and use "
                         "benchmarks/scale_gpu.py to compare local and Ray mode")
    task = None
    if cfg.data.prompt_file is None or Path(cfg.data.prompt_file).is_file():
        task = build_task(cfg)

    group = WorkerGroup.create(cfg, build)
    worker = group.local_worker
    device = torch.device(cfg.model.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    manager = AgentLoopManager.create(cfg.rollout, worker.model, replicas=group.replicas)
    try:
        timings, out = rl_steps(group, manager, cfg, steps + 1, log, task)
        forward_s, forward_flops = bare_forward(worker.model, out, cfg, device)
        update_flops = estimated_update_flops(worker.actor, out, forward_flops, cfg)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        dtype = getattr(torch, cfg.model.dtype)  # not a parameter's: Wan keeps some of its weights float32
        peak_tflops = matmul_tflops(device, dtype)
    finally:
        manager.shutdown()
        group.shutdown()
    timed_steps = timings[1:]  # the first step pays one-off costs

    def mean(key):
        values = [t[key] for t in timed_steps if t[key] is not None]
        return statistics.mean(values) if values else None

    rows, steps_per_sample = len(out), cfg.rollout.pipeline.num_inference_steps
    rollout_flops = forward_flops * steps_per_sample
    figures = {
        "rows": rows, "steps_timed": len(timed_steps), "device": _device_name(device), "dtype": str(dtype),
        "matmul_tflops": peak_tflops,
        "ceiling": {"seconds": forward_s, "images_per_s": rows / forward_s, "tflops": rollout_flops / forward_s / 1e12},
        "rollout": {"seconds": mean("rollout_s"), "engine_seconds": mean("engine_s"),
                    "engine_phase_seconds": {phase: mean(f"{phase}_s") for phase in PHASES},
                    "slowest_reward_seconds": mean("reward_max_s"),
                    "images_per_s": rows / mean("rollout_s"), "tflops": rollout_flops / mean("rollout_s") / 1e12},
        "update": {"seconds": mean("update_s"), "compute_seconds": mean("update_compute_s"),
                   "tflops": update_flops / mean("update_s") / 1e12},
        "step": {"seconds": mean("step_s"), "images_per_s": rows / mean("step_s"),
                 "tflops": (rollout_flops + update_flops) / mean("step_s") / 1e12, "sync_seconds": mean("sync_s")},
        "peak_memory_gib": peak,
        "rollout_vs_replay_logprob_gap": max((t["correction_max"] or 0.0) for t in timed_steps),
        "rollout_vs_replay_logprob_gap_mean": mean("correction_mean"),
    }
    for part in ("ceiling", "rollout", "update", "step"):
        figures[part]["mfu"] = figures[part]["tflops"] / peak_tflops
    figures["rollout"]["of_ceiling"] = figures["rollout"]["images_per_s"] / figures["ceiling"]["images_per_s"]
    return figures


def bench_command(cfg, random_family: str | None, steps: int, json_path: str | None) -> None:
    """`flowloop bench`: run, print the table, write the JSON."""
    import json
    from pathlib import Path

    build = random_model_builder(random_family, cfg) if random_family else None
    figures = run_bench(cfg, build, steps=steps)
    print(format_figures(figures))
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {json_path}")


def format_figures(figures: dict) -> str:
    """The figures as a small table (the JSON holds everything)."""
    lines = [f"{figures['device']}, {figures['dtype']}, {figures['rows']} rows a step, dense matmul "
             f"{figures['matmul_tflops']:.1f} TFLOP/s",
             f"{'part':10} {'seconds':>9} {'images/s':>9} {'TFLOP/s':>8} {'MFU':>6}"]
    for part in ("ceiling", "rollout", "update", "step"):
        f = figures[part]
        images = "-" if f.get("images_per_s") is None else f"{f['images_per_s']:.3f}"
        lines.append(f"{part:10} {f['seconds']:9.3f} {images:>9} {f['tflops']:8.2f} {f['mfu']:6.1%}")
    phases = figures["rollout"]["engine_phase_seconds"]
    lines.append("rollout engine: " + ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in phases.items()))
    rollout = figures["rollout"]
    if rollout["slowest_reward_seconds"] is not None:
        lines.append(f"outside the engine {rollout['seconds'] - rollout['engine_seconds']:.3f} s (agent loop and reward; "
                     f"the slowest row's reward {rollout['slowest_reward_seconds']:.3f} s)")
    gap_mean = figures["rollout_vs_replay_logprob_gap_mean"]
    lines.append(f"rollout / ceiling {figures['rollout']['of_ceiling']:.2f}; rollout-vs-replay log-prob gap "
                 f"{figures['rollout_vs_replay_logprob_gap']:.2e} max"
                 + ("" if gap_mean is None else f", {gap_mean:.2e} mean") + "; peak memory "
                 + (f"{figures['peak_memory_gib']:.1f} GiB" if figures['peak_memory_gib'] is not None else "n/a (CPU)"))
    return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def random_model_builder(family: str, cfg):
    """A picklable factory of ``family`` at its published size with random weights (in
    ``cfg.model.dtype`` on ``cfg.model.device``): the configs live in benchmarks/real_models.py,
    so this needs a checkout of the repository, not an installed wheel."""
    import functools
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "real_models.py").is_file():
        raise ValueError("--random needs benchmarks/real_models.py from a checkout of the flowloop repository; "
                         "or pass model.path=<a local diffusers folder>")
    sys.path.insert(0, str(root))
    real = importlib.import_module("benchmarks.real_models")
    if family not in real.REAL:
        raise ValueError(f"--random {family!r}: known families {sorted(real.REAL)}")
    return functools.partial(_build_random, family, dict(cfg.model.options), cfg.model.device, cfg.model.dtype)


def _build_random(family: str, options: dict, device: str, dtype: str):
    from benchmarks.real_models import REAL, build_model

    torch.manual_seed(0)
    return build_model(family, REAL, options, device, getattr(torch, dtype))

"""Measure GPU levers before/after in one session: one `flowloop bench` process per setting.

    python benchmarks/gpu_levers.py --family sd3 --out $OUT/levers \
        --lever "eager: model.compile=false model.autocast=false" --lever "compile: model.compile=true"

Every lever runs the same real-size model (random weights) with the same shared overrides (512x512,
10 steps, SDE window 2, the recipe's CFG and LoRA, one prompt x ``--n``); each is a fresh process
so one setting's compiled graphs or cached memory do not leak into the next. ``--rounds 2`` runs
the list twice, the second time in reverse order, because a freshly started card runs its first
minutes slower. Writes ``OUT/NAME_roundR.json`` (the `flowloop bench` figures) and prints a
markdown table with one row per setting and round.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

FAMILIES = ("sd3", "qwen_image", "flux", "wan")  # each family's shipped recipe has its name

SHARED = ("model.device=cuda rollout.pipeline.height=512 rollout.pipeline.width=512 "
          "rollout.pipeline.num_inference_steps=10 rollout.algo.sde_window_size=2 "
          "rollout.algo.sde_window_range=[0,5] model.gradient_checkpointing=true "
          "rollout.reward.name=jpeg_compressibility data.prompts_per_step=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--lever", action="append", required=True, help='"name: key=value key=value"')
    parser.add_argument("--n", type=int, default=8, help="samples a step (one prompt's group)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="timed RL steps after the warm-up step")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--extra", default="", help="overrides shared by every lever")
    parser.add_argument("--out", default="runs/levers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levers = [tuple(part.strip() for part in spec.partition(":")[::2]) for spec in args.lever]
    shared = shared_overrides(args.n, args.micro_batch, args.extra)
    rows = []
    for round_ in range(args.rounds):
        for name, overrides in (levers if round_ % 2 == 0 else levers[::-1]):
            result = out / f"{name}_round{round_}.json"
            cmd = [sys.executable, "-m", "flowloop.cli", "bench", "--recipe", args.family,
                   "--random", args.family, "--steps", str(args.steps), "--json", str(result),
                   *shlex.split(shared), *shlex.split(overrides)]
            with open(out / f"{name}_round{round_}.log", "w") as log:
                code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
            if code or not result.exists():
                print(f"{name} (round {round_}) failed with exit code {code}: see {log.name}", flush=True)
                continue
            rows.append((name, round_, json.loads(result.read_text())))
            print(table_row(*rows[-1]), flush=True)
    print(f"\n{rows[0][2]['device'] if rows else ''}, {args.family}, {args.n} images a step")
    print("| lever | round | ceiling img/s | rollout img/s | update s | RL step img/s | rollout / ceiling "
          "| step MFU | log-prob gap max / mean | peak GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(table_row(*row))


def shared_overrides(n: int, micro_batch: int, extra: str = "") -> str:
    """`SHARED` for one prompt x ``n`` samples a step, trained in micro-batches of ``micro_batch``."""
    return f"{SHARED} rollout.n={n} actor.mini_batch_size={n} actor.micro_batch_size={micro_batch} {extra}"


def table_row(name: str, round_: int, f: dict) -> str:
    mean = f.get("rollout_vs_replay_logprob_gap_mean")
    gap_mean = "-" if mean is None else f"{mean:.1e}"
    return (f"| {name} | {round_} | {f['ceiling']['images_per_s']:.3f} | {f['rollout']['images_per_s']:.3f} "
            f"| {f['update']['seconds']:.2f} | {f['step']['images_per_s']:.3f} | {f['rollout']['of_ceiling']:.2f} "
            f"| {f['step']['mfu']:.1%} | {f['rollout_vs_replay_logprob_gap']:.1e} / {gap_mean} "
            f"| {f['peak_memory_gib']:.1f} |")


if __name__ == "__main__":
    main()

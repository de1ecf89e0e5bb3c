"""Scale-out on CPUs through Ray: rollout samples/s with 1 and 2 replicas, and the RL step time
of the colocated and disaggregated placements, measured side by side in one run.

    python benchmarks/scale_cpu.py --steps 4 --out /tmp/scale_cpu.json     # 2-core CPU: ~10 min

Every setting trains the shapes recipe (the embedded model) for ``--steps`` steps through
`flowloop train` with ``scale.mode=ray`` on a local Ray cluster, and reads the steps' times from
its metrics.jsonl (the first step is left out: it pays the one-off costs). Figures:
``samples/s`` = rows per step / ``time/generate``; ``step_s`` = mean ``time/step``;
``sync_s`` = mean ``time/weight_sync``. With ``rollout.max_staleness`` 1 the next step's rows
sample during the update, so ``time/generate`` is only the time the trainer waited for them. Ranks and replicas each get ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "local, 1 process": ["scale.mode=local"],
    "ray colocated, 1 rank": ["scale.mode=ray", "scale.placement=colocated"],
    "ray disaggregated, 1 rank + 1 replica": ["scale.mode=ray", "scale.placement=disaggregated", "scale.rollout_replicas=1"],
    "ray disaggregated, 1 rank + 1 replica, max_staleness 1": ["scale.mode=ray", "scale.placement=disaggregated",
                                                               "scale.rollout_replicas=1", "rollout.max_staleness=1"],
    "ray disaggregated, 1 rank + 2 replicas": ["scale.mode=ray", "scale.placement=disaggregated", "scale.rollout_replicas=2"],
    "ray colocated, 2 ranks": ["scale.mode=ray", "scale.placement=colocated", "scale.world_size=2"],
}


def measure(name: str, overrides: list[str], args, root: Path) -> dict:
    import ray
    import torch

    from flowloop.cli import main

    torch.set_num_threads(args.threads)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False) if "scale.mode=ray" in overrides else None
    run_name = name.replace(" ", "_").replace(",", "").replace("+", "p")
    code = main(["train", f"trainer.total_steps={args.steps}", f"trainer.run_root={root}", f"trainer.run_name={run_name}",
                 f"data.prompts_per_step={args.prompts}", "trainer.val_every=1000", "trainer.val_samples_per_category=1",
                 "trainer.save_every=1000", *overrides])
    if ray.is_initialized():
        ray.shutdown()
    if code != 0:
        return {"setting": name, "error": f"exit {code}"}
    rows = [json.loads(line) for line in (root / run_name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r][1:]  # the first step pays one-off costs
    per_step = args.prompts * 16
    return {
        "setting": name,
        # Sampling ahead, time/generate is only the wait after the update: no sampling rate to read.
        "samples_per_s": None if "rollout.max_staleness=1" in overrides
        else statistics.mean(per_step / r["time/generate"] for r in steps),
        "step_s": statistics.mean(r["time/step"] for r in steps),
        "update_s": statistics.mean(r["time/update"] for r in steps),
        "sync_s": statistics.mean(r.get("time/weight_sync", 0.0) for r in steps),
        "steps_timed": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="RL steps per setting (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x16 samples)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--only", nargs="*", default=None, help="a subset of the settings, by name")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SETTINGS.items():
            if args.only and name not in args.only:
                continue
            results.append(measure(name, overrides, args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{'setting':56} {'samples/s':>10} {'step_s':>8} {'update_s':>9} {'sync_s':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['setting']:56} {r['error']}")
        else:
            rate = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.2f}"
            print(f"{r['setting']:56} {rate:>10} {r['step_s']:8.2f} {r['update_s']:9.2f} {r['sync_s']:8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Run several `flowloop train` configurations side by side and tabulate held-out accuracy.

    python benchmarks/recipe_sweep.py --minutes 8 --out runs/sweep \
        --base "model.device=cuda trainer.total_steps=300" \
        --variant "lr1e-5: actor.lr=1e-5" --variant "lr3e-5: actor.lr=3e-5"

Each variant is one subprocess (``trainer.num_threads=2``), stopped after ``--minutes`` (its
``metrics.jsonl`` is written every step, so a stopped run still reports). Prints, per variant:
steps done, seconds per step, held-out accuracy before, best (and at which step), and last.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--base", default="", help="overrides shared by every variant")
    parser.add_argument("--variant", action="append", required=True, help='"name: key=value key=value"')
    args = parser.parse_args()
    procs = {}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        name = name.strip()
        cmd = [sys.executable, "-m", "flowloop.cli", "train", *shlex.split(args.base), *shlex.split(overrides),
               f"trainer.run_root={args.out}", f"trainer.run_name={name}", "trainer.num_threads=2"]
        log = open(Path(args.out).mkdir(parents=True, exist_ok=True) or Path(args.out) / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.time() + 60 * args.minutes
    while time.time() < deadline and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(5)
    for proc, log in procs.values():
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        log.close()
    print(f"{'variant':<14} {'steps':>5} {'s/step':>7} {'before':>7} {'best':>7} {'@step':>6} {'last':>7}")
    for name in procs:
        path = Path(args.out) / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        val = [(r["step"], r["val/accuracy"]) for r in rows if r.get("val/accuracy") is not None]
        steps = [r for r in rows if r.get("time/step")]
        if not val:
            print(f"{name:<14} no validation yet (see {args.out}/{name}.log)")
            continue
        best = max(val, key=lambda sv: sv[1])
        per_step = sum(r["time/step"] for r in steps) / max(len(steps), 1)
        print(f"{name:<14} {len(steps):>5} {per_step:>7.2f} {val[0][1]:>7.1%} {best[1]:>7.1%} {best[0]:>6} {val[-1][1]:>7.1%}")


if __name__ == "__main__":
    main()

"""Compare how runs trained, from their ``metrics.jsonl`` alone: the training reward's curve and the
update's per-window-step statistics, averaged over the first and the last ``--window`` steps.

    python benchmarks/run_diagnostics.py runs/fg/fg0 runs/fg/fg1 runs/nft/t4cos --window 20

One row per run and metric: mean over steps 1..window, mean over the run's last ``window`` steps.
Metrics: ``reward/mean``, ``reward/correct``, ``reward/surplus_objects``, ``actor/grad_norm`` and,
where the objective logs them (FlowGRPO), ``actor/clip_frac_stepJ``, ``actor/approx_kl_stepJ``
and ``actor/adv_log_ratio_stepJ`` for every window step J.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from flowloop.plot import read_rows

FIXED = ("reward/mean", "reward/correct", "reward/surplus_objects", "actor/grad_norm")
PER_STEP = re.compile(r"actor/(clip_frac|approx_kl|adv_log_ratio)_step\d+$")


def train_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: give run folders (each holds a metrics.jsonl)")
    return [row for row in read_rows(path) if "reward/mean" in row]  # a stopped run's torn last line is skipped


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end of the run")
    args = parser.parse_args()
    print(f"| run | metric | steps 1-{args.window} | last {args.window} steps |")
    print("| --- | --- | ---: | ---: |")
    for run in args.runs:
        rows = train_rows(run)
        keys = [*FIXED, *sorted({k for row in rows for k in row if PER_STEP.match(k)})]
        first, last = rows[:args.window], rows[-args.window:]
        for key in keys:
            if any(key in row for row in rows):
                print(f"| {run.name} ({len(rows)} steps) | {key} | {mean(first, key):.4g} | {mean(last, key):.4g} |")


if __name__ == "__main__":
    main()

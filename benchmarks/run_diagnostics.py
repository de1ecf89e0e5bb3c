"""Compare how runs trained, from their ``metrics.jsonl`` alone: the training reward's curve and the
update's per-window-step statistics, averaged over the first and the last ``--window`` steps.

    python benchmarks/run_diagnostics.py runs/fg/fg0 runs/fg/fg1 runs/nft/t4cos --window 20 [--plot runs.png]

One row per run and metric: mean over steps 1..window, mean over the run's last ``window`` steps.
Metrics: ``reward/mean``, ``reward/correct``, ``reward/surplus_objects``, ``actor/grad_norm`` and,
where the objective logs them (FlowGRPO), ``actor/clip_frac_stepJ``, ``actor/approx_kl_stepJ``
and ``actor/adv_log_ratio_stepJ`` for every window step J.

``--plot PNG`` draws the runs side by side: the training samples' exact-match share (a
``--window``-step trailing mean), the in-run held-out validation, and, for runs that log them
(FlowGRPO), two profiles over the denoising steps the update trains: the approximate KL between
the updated and the sampling policy (log scale) and the share of clipped rows, each the mean over
the whole run.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from flowloop.plot import read_rows, trailing_mean

FIXED = ("reward/mean", "reward/correct", "reward/surplus_objects", "actor/grad_norm")
PER_STEP = re.compile(r"actor/(clip_frac|approx_kl|adv_log_ratio)_step\d+$")


def metric_rows(run: Path) -> list[dict]:
    """Every record of the run's ``metrics.jsonl`` (a stopped run's torn last line is skipped)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: give run folders (each holds a metrics.jsonl)")
    return read_rows(path)


def train_rows(rows: list[dict]) -> list[dict]:
    """The training steps' records (validation records carry no ``reward/mean``)."""
    return [row for row in rows if "reward/mean" in row]


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end of the run")
    parser.add_argument("--plot", type=Path, help="also draw the runs' curves into this PNG")
    args = parser.parse_args()
    print(f"| run | metric | steps 1-{args.window} | last {args.window} steps |")
    print("| --- | --- | ---: | ---: |")
    records = {run: metric_rows(run) for run in args.runs}
    for run, all_rows in records.items():
        rows = train_rows(all_rows)
        keys = [*FIXED, *sorted({k for row in rows for k in row if PER_STEP.match(k)}, key=per_step_order)]
        first, last = rows[:args.window], rows[-args.window:]
        for key in keys:
            if any(key in row for row in rows):
                print(f"| {run.name} ({len(rows)} steps) | {key} | {mean(first, key):.4g} | {mean(last, key):.4g} |")
    if args.plot:
        plot_runs(records, args.plot, args.window)
        print(f"plot: {args.plot}")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that hold it."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [step for step, _ in points], [value for _, value in points]


def per_step_order(key: str) -> tuple[str, int]:
    """``actor/NAME_stepJ`` -> (NAME, J): per-step keys sorted by metric, then in denoising order
    (``step10`` after ``step2``)."""
    name, _, step = key.rpartition("_step")
    return name, int(step)


def step_profile(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(window steps j, run mean of ``actor/{name}_step{j}``), in denoising order."""
    keys = sorted({k for row in rows for k in row if k.startswith(f"actor/{name}_step")}, key=per_step_order)
    return [per_step_order(k)[1] for k in keys], [mean(rows, k) for k in keys]


def plot_runs(records: dict[Path, list[dict]], out: Path, window: int) -> None:
    """Four panels, one line per run: training exact-match share, held-out validation, and per
    window step the run's mean approximate KL and clipped share (FlowGRPO runs only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax, kl_ax, clip_ax) = plt.subplots(1, 4, figsize=(19, 4.2))
    for i, (run, rows) in enumerate(records.items()):
        style = {"label": run.name, "color": f"C{i}"}  # one colour per run in every panel
        steps, correct = series(rows, "reward/correct")
        train_ax.plot(steps, trailing_mean(correct, window), **style)
        steps, strict = series(rows, "val/strict_accuracy")
        val_ax.plot(steps, [100 * v for v in strict], marker="o", **style)
        trained = train_rows(rows)
        for ax, name in ((kl_ax, "approx_kl"), (clip_ax, "clip_frac")):
            js, values = step_profile(trained, name)
            if js:
                ax.plot(js, [100 * v for v in values] if name == "clip_frac" else values, marker="o", **style)
    train_ax.set(title=f"training samples drawn exactly right ({window}-step mean)", xlabel="RL step", ylabel="share")
    val_ax.set(title="in-run held-out validation, strict", xlabel="RL step", ylabel="%")
    kl_ax.set(title="approximate KL to the sampling policy (run mean)", xlabel="denoising step trained", yscale="log")
    clip_ax.set(title="rows clipped by the trust region (run mean)", xlabel="denoising step trained", ylabel="%")
    for ax in (train_ax, val_ax, kl_ax, clip_ax):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

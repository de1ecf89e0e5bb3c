"""Learning curves from a run's ``metrics.jsonl``: training accuracy by category and held-out accuracy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flowloop.trainer.metrics_log import CATEGORY_PREFIX, accuracy_key, category_names


def category_training_series(rows: list[dict], window: int = 10) -> dict[str, tuple[list[int], list[float]]]:
    """``{category: (steps, values)}`` of the training accuracy per prompt category (the mean reward
    where the reward reports no accuracy), each value the mean of that category's last ``window``
    logged steps. One step holds a category's one or two groups, so the raw series is too noisy to
    read; the trailing mean shows whether the category is learning."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    keys = {k for r in rows for k in r}
    for name in category_names(keys):
        key = accuracy_key(f"{CATEGORY_PREFIX}{name}", keys)
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        series[name] = ([s for s, _ in points], trailing_mean([v for _, v in points], window))
    return series


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value replaced by the mean of it and the ``window - 1`` before it (fewer at the start)."""
    means = []
    for i in range(len(values)):
        recent = values[max(0, i + 1 - window):i + 1]
        means.append(sum(recent) / len(recent))
    return means


def rollout_sampler_and_objective(run_dir: Path) -> tuple[str, str]:
    """How the run's training rollouts were sampled ("SDE", "ODE" for the ODE or zero noise, ...)
    and its update's objective, from the ``config.yaml`` `flowloop train` writes (defaults when absent)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return "SDE", "flow_grpo"
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    algo = OmegaConf.select(cfg, "rollout.algo", default={}) or {}
    sampler = str(algo.get("sampler", "sde"))
    noise_free = sampler == "ode" or algo.get("noise_level", 1.0) == 0
    return "ODE" if noise_free else sampler.upper(), str(OmegaConf.select(cfg, "actor.objective", default="flow_grpo"))


def read_rows(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``. A torn last line (a run killed mid-write) is skipped
    with a warning; an unreadable line before it is a ValueError naming the line."""
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1) if line.strip()]
    rows = []
    for index, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if index == len(lines) - 1:
                logging.getLogger(__name__).warning("%s: skipped the torn last line %d (a run stopped mid-write)", path, number)
                continue
            raise ValueError(f"{path} line {number} is not JSON ({line[:40]!r}...); remove that line and plot again") from None
    return rows


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a two-panel PNG (training accuracy by category per step; held-out strict accuracy
    by category per validation, same colours, the GenEval-style overall dashed) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: point flowloop plot at a run folder made by flowloop train")
    rows = read_rows(path)
    train = [r for r in rows if r.get("reward/mean") is not None]
    val = [r for r in rows if r.get("val/accuracy") is not None]
    by_category = category_training_series(train)
    val_categories = sorted({k.split("/")[1] for r in val for k in r if k.startswith("val/") and k.endswith("/accuracy") and k.count("/") == 2})
    palette = plt.get_cmap("tab10")
    colour = {name: palette(i % 10) for i, name in enumerate(sorted(set(by_category) | set(val_categories)))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for name, (steps, values) in by_category.items():
        left.plot(steps, values, lw=1, color=colour[name], label=name)
    overall = accuracy_key("reward", train[0] if train else {})
    steps, values = [r["step"] for r in train], [r[overall] for r in train]
    left.plot(steps, values, "-", color="0.6", lw=0.6)
    left.plot(steps, trailing_mean(values, 10), "k-", lw=2, label="overall")
    left.set_xlabel("step")
    left.set_ylim(0, 1.02)
    measure = "accuracy" if overall == "reward/correct" else "reward"
    sampler, objective = rollout_sampler_and_objective(run_dir)
    left.set_title(f"training {measure} ({sampler} rollouts; mean of the last 10 steps, grey: each step)", fontsize=9)
    left.grid(alpha=0.3)
    held = "strict_accuracy" if any("val/strict_accuracy" in r for r in val) else "accuracy"  # runs before strict: GenEval-style
    val_steps = [r["step"] for r in val]
    for name in val_categories:
        right.plot(val_steps, [r.get(f"val/{name}/{held}") for r in val], lw=1, color=colour[name], label=name)
    right.plot(val_steps, [r[f"val/{held}"] for r in val], "k-o", lw=2, ms=3, label="overall")
    if held == "strict_accuracy":
        right.plot(val_steps, [r["val/accuracy"] for r in val], "k--", lw=1, label="overall, GenEval-style")
    right.set_xlabel("step")
    right.set_ylim(0, 1.02)
    right.set_title(f"held-out {held.replace('_', ' ')} (ODE, fixed seeds)", fontsize=9)
    right.grid(alpha=0.3)
    handles = {}  # one legend for both panels: a category has the same colour in each
    for axis in (left, right):
        handles.update((label, line) for line, label in zip(*axis.get_legend_handles_labels()))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"{run_dir.name} ({objective})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out = Path(out) if out else run_dir / "curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out

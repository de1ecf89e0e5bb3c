"""Learning curves from a run's ``metrics.jsonl``: training reward and held-out accuracy."""

from __future__ import annotations

from pathlib import Path

from flowloop.trainer.metrics_log import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a two-panel PNG (reward per step; held-out accuracy per validation) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: point flowloop plot at a run folder made by flowloop train")
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("reward/mean") is not None]
    val = [r for r in rows if r.get("val/accuracy") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    left.plot([r["step"] for r in train], [r["reward/mean"] for r in train], lw=1, label="reward (mean score)")
    if train and "reward/correct" in train[0]:
        left.plot([r["step"] for r in train], [r["reward/correct"] for r in train], lw=1, label="train accuracy")
    left.set_xlabel("step")
    left.set_title("training rollouts (SDE)")
    left.legend(loc="lower right")
    left.grid(alpha=0.3)
    categories = sorted({k.split("/")[1] for r in val for k in r if k.startswith("val/") and k.endswith("/accuracy") and k.count("/") == 2})
    for name in categories:
        right.plot([r["step"] for r in val], [r.get(f"val/{name}/accuracy") for r in val], lw=0.8, alpha=0.6, label=name)
    right.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "k-o", lw=2, ms=3, label="overall")
    right.set_xlabel("step")
    right.set_ylim(0, 1)
    right.set_title("held-out accuracy (ODE, fixed seeds)")
    right.legend(loc="lower right", fontsize=7, ncol=2)
    right.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out

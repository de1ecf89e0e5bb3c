"""What a training step logs about its rows' rewards, beside the update's own metrics: the mean of
every numeric reward extra-info column, and the reward split by prompt category."""

from __future__ import annotations

import numpy as np
import torch

from flowloop.protocol import Batch
from flowloop.reward.worker import ERROR_KEY
from flowloop.trainer.metrics_log import CATEGORY_PREFIX


def reward_extra_means(out: Batch) -> dict[str, float]:
    """``reward/<key>``: the mean of every numeric reward extra-info column the reward declared
    (``meta_info["reward_extra_keys"]``; bools count 0/1, so ``correct`` gives the accuracy). A
    key already starting with ``reward/`` (a combined reward's parts) keeps its name. Missing
    values (None) are left out; columns of other types (dicts, strings, errors) are skipped."""
    means = {}
    for key in out.meta_info.get("reward_extra_keys", []):
        if key == ERROR_KEY or key not in out:
            continue
        values = [v for v in out[key] if v is not None]
        if values and all(isinstance(v, (bool, int, float, np.bool_, np.number)) for v in values):
            means[key if key.startswith("reward/") else f"reward/{key}"] = float(np.mean([float(v) for v in values]))
    return means


def category_reward_means(out: Batch, rewards: torch.Tensor) -> dict[str, float]:
    """``reward/category/<name>/mean`` (and ``.../correct`` when the reward reports it) for each
    value of the batch's ``category`` column: the shapes world's six, or a prompt file's own
    ``category`` field. The overall mean hides which kinds of prompt are learning; a single
    category's line in ``metrics.jsonl`` shows it. Rows without a category are left out."""
    if "category" not in out:
        return {}
    means = {}
    categories = list(out["category"])
    correct = list(out["correct"]) if "correct" in out else None
    for name in sorted({c for c in categories if c is not None}, key=str):
        rows = [i for i, c in enumerate(categories) if c == name]
        means[f"{CATEGORY_PREFIX}{name}/mean"] = float(rewards[rows].mean())
        if correct is not None:
            means[f"{CATEGORY_PREFIX}{name}/correct"] = float(np.mean([float(correct[i]) for i in rows]))
    return means


__all__ = ["category_reward_means", "reward_extra_means"]

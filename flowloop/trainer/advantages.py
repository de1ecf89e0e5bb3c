"""Advantage estimators: how one step's rewards become per-row advantages, registered by name.

A group is the rows that share a ``uid`` (the n samples of one prompt in one step). Every
estimator centres a row's reward on a baseline; they differ in the baseline and the scale
(``eps = 1e-4``, as Flow-GRPO):

    grpo        (r - mean_group) / (std_group + eps)    Flow-GRPO / GRPO
    global_std  (r - mean_group) / (std_batch + eps)    Flow-GRPO's ``global_std`` option
    drgrpo      r - mean_group                          Dr. GRPO: no std
    per_prompt  (r - mean_hist) / (std_hist + eps)      the prompt's rewards across steps
                                                        (`PerPromptStatTracker`)

Every std is the population std (``unbiased=False``, numpy's ``ddof=0``), as flow_grpo's
``np.std``: a group of two rewards {0, 1} has std 0.5, so its advantages are about +-1.

``compute_advantages`` also measures the zero-variance groups (all rewards equal: they carry no
learning signal) and, with ``drop_zero_std_groups=True``, marks their rows as not kept and sets
their advantages to 0. Estimators run in float64; advantages come back in the rewards' dtype.

Add an estimator with::

    @register_advantage("mine")
    def mine(rewards, groups, *, my_option=1.0):  # rewards [B] float64, groups: `Groups`
        return ...                                # [B] float64
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "ADVANTAGES",
    "AdvantageResult",
    "Groups",
    "PerPromptStatTracker",
    "compute_advantages",
    "group_stats",
    "register_advantage",
]

EPS = 1e-4
"""Added to every std before dividing (Flow-GRPO's value)."""


class Groups(NamedTuple):
    """The rows of a batch grouped by ``uid`` (groups numbered in order of first appearance)."""

    index: torch.Tensor
    """``[B]`` long: the group of each row."""
    count: torch.Tensor
    """``[G]`` rows per group."""
    mean: torch.Tensor
    """``[G]`` float64 mean reward of each group."""
    std: torch.Tensor
    """``[G]`` float64 population std (``unbiased=False``) of each group's rewards."""
    zero_std: torch.Tensor
    """``[G]`` bool: every reward of the group is equal (a group of one row included)."""


class AdvantageResult(NamedTuple):
    """What `compute_advantages` returns."""

    advantages: torch.Tensor
    """``[B]`` in the rewards' dtype; 0 on rows that are not kept."""
    stats: dict[str, float]
    """Scalars for logging (see `compute_advantages`)."""
    keep: torch.Tensor
    """``[B]`` bool: rows to train on (all True unless ``drop_zero_std_groups``)."""


AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}
"""Estimators by the name used in config; fill it with `register_advantage`."""


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(rewards [B] float64, groups: Groups, **options) -> [B]`` under ``name``."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return decorator


def group_stats(rewards: torch.Tensor, uids: Sequence | np.ndarray) -> Groups:
    """Group ``rewards [B]`` by ``uids`` (any hashable per row) and measure each group in float64."""
    numbers: dict = {}
    index = torch.tensor([numbers.setdefault(uid, len(numbers)) for uid in uids], dtype=torch.long)  # [B]
    index = index.to(rewards.device)
    r = rewards.to(torch.float64)  # [B]
    num_groups = len(numbers)
    count = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add_(0, index, torch.ones_like(index))
    mean = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, index, r) / count  # [G]
    sq_dev = (r - mean[index]) ** 2  # [B]
    std = (torch.zeros_like(mean).index_add_(0, index, sq_dev) / count).sqrt()  # [G]
    # All-equal test on the values themselves: a float mean of equal values can differ from them.
    high = torch.full_like(mean, -torch.inf).scatter_reduce(0, index, r, "amax")
    low = torch.full_like(mean, torch.inf).scatter_reduce(0, index, r, "amin")
    return Groups(index, count, mean, std, high == low)


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    uids: Sequence | np.ndarray,
    *,
    drop_zero_std_groups: bool = False,
    **options,
) -> AdvantageResult:
    """Advantages ``[B]`` of ``rewards [B]`` with the estimator registered as ``name``.

    ``uids``: one hashable per row (``batch.non_tensors["uid"]``); rows with one uid form a group.
    ``options`` go to the estimator (``per_prompt`` needs ``tracker=`` and ``prompts=``).
    ``stats``: ``num_groups``, ``zero_std_group_frac`` (share of groups whose rewards are all
    equal), ``group_reward_std_mean`` (mean within-group std), ``kept_frac`` (share of rows kept),
    ``advantage_abs_mean`` (over kept rows; 0 when none is kept).
    """
    # 1. Validate the estimator, its options and the inputs.
    fn = _estimator(name, options)
    if not isinstance(rewards, torch.Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor [B], got {_describe(rewards)}")
    if len(uids) != rewards.shape[0]:
        raise ValueError(f"uids has {len(uids)} entries but rewards has {rewards.shape[0]} rows")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards must be finite; rows {bad[:10]} are NaN or inf")

    # 2. Group by uid, run the estimator.
    groups = group_stats(rewards, uids)
    advantages = fn(rewards.to(torch.float64), groups, **options)  # [B] float64

    # 3. Keep-mask: zero-variance groups carry no signal; dropped rows get advantage 0.
    if drop_zero_std_groups:
        keep = ~groups.zero_std[groups.index]  # [B]
    else:
        keep = torch.ones_like(groups.index, dtype=torch.bool)  # [B]
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))

    kept = int(keep.sum())
    stats = {
        "num_groups": float(len(groups.count)),
        "zero_std_group_frac": groups.zero_std.double().mean().item() if len(groups.count) else 0.0,
        "group_reward_std_mean": groups.std.mean().item() if len(groups.count) else 0.0,
        "kept_frac": kept / max(len(keep), 1),
        "advantage_abs_mean": advantages[keep].abs().mean().item() if kept else 0.0,
    }
    return AdvantageResult(advantages.to(rewards.dtype), stats, keep)


# ---------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, groups: Groups, *, eps: float = EPS) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)``, the population std of the row's group."""
    return (rewards - groups.mean[groups.index]) / (groups.std[groups.index] + eps)


@register_advantage("global_std")
def global_std(rewards: torch.Tensor, groups: Groups, *, eps: float = EPS) -> torch.Tensor:
    """``(r - mean_group) / (std_batch + eps)``: one scale for the batch (population std)."""
    return (rewards - groups.mean[groups.index]) / (rewards.std(unbiased=False) + eps)


@register_advantage("drgrpo")
def drgrpo(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``r - mean_group``: Dr. GRPO drops the std, which over-weights near-uniform groups."""
    return rewards - groups.mean[groups.index]


@register_advantage("per_prompt")
def per_prompt(
    rewards: torch.Tensor, groups: Groups, *, tracker: PerPromptStatTracker, prompts: Sequence
) -> torch.Tensor:
    """The prompt's history across steps (see `PerPromptStatTracker`); ``prompts``: one key per row."""
    del groups  # the tracker groups by prompt across steps, not by this step's uid
    return torch.as_tensor(tracker.update(prompts, rewards.cpu().numpy()), device=rewards.device)


class PerPromptStatTracker:
    """Per-prompt reward history across steps (DDPO's and Flow-GRPO's ``PerPromptStatTracker``).

    Each prompt keeps a buffer of its ``buffer_size`` most recent rewards (None: all of them).
    `update` first appends this step's rewards to every prompt's buffer, then gives each row
    ``(r - mean) / (std + eps)`` where mean and std (population) are

    - those of the prompt's buffer, once it holds at least ``min_count`` rewards;
    - those of the whole current batch otherwise (DDPO's fallback for rarely seen prompts).

    ``global_std=True`` always divides by the current batch's std (Flow-GRPO's ``global_std``).
    Defaults are DDPO's (``buffer_size=16``, ``min_count=16``): with groups of n >= 16 the
    first step normalizes by the group itself, later steps by the last 16 rewards. Flow-GRPO's
    scripts call `clear` after every step, which makes this the plain ``grpo`` estimator.
    Save `state_dict` in checkpoints so a resumed run keeps its history.
    """

    def __init__(self, buffer_size: int | None = 16, min_count: int = 16, global_std: bool = False, eps: float = EPS):
        if buffer_size is not None and (not isinstance(buffer_size, int) or buffer_size < 1):
            raise ValueError(f"buffer_size must be None (keep every reward) or an int >= 1, got {buffer_size!r}")
        if not isinstance(min_count, int) or min_count < 0:
            raise ValueError(f"min_count must be an int >= 0, got {min_count!r}")
        if buffer_size is not None and min_count > buffer_size:
            raise ValueError(f"min_count ({min_count}) must be <= buffer_size ({buffer_size}) or it is never reached")
        self.buffer_size, self.min_count, self.global_std, self.eps = buffer_size, min_count, global_std, eps
        self.history: dict = {}
        """prompt -> deque of its most recent rewards."""

    def update(self, prompts: Sequence, rewards: Sequence[float] | np.ndarray) -> np.ndarray:
        """Record this step's ``rewards [B]`` under ``prompts [B]``; return the advantages ``[B]`` float64."""
        rewards = np.asarray(rewards, dtype=np.float64)
        if rewards.ndim != 1 or len(prompts) != len(rewards):
            raise ValueError(f"prompts ({len(prompts)}) and rewards {rewards.shape} must be two lists of B items")
        rows: dict = {}
        for i, prompt in enumerate(prompts):
            rows.setdefault(prompt, []).append(i)
        # 1. Record every prompt's rewards first (as Flow-GRPO), then normalize.
        for prompt, idx in rows.items():
            self.history.setdefault(prompt, deque(maxlen=self.buffer_size)).extend(rewards[idx].tolist())
        advantages = np.empty_like(rewards)  # [B]
        batch_mean, batch_std = rewards.mean(), rewards.std()
        for prompt, idx in rows.items():
            buffer = np.asarray(self.history[prompt])
            mean, std = (buffer.mean(), buffer.std()) if len(buffer) >= self.min_count else (batch_mean, batch_std)
            advantages[idx] = (rewards[idx] - mean) / ((batch_std if self.global_std else std) + self.eps)
        return advantages

    def stats(self) -> dict[str, float]:
        """``tracked_prompts`` and ``mean_buffer_len`` for logging."""
        sizes = [len(v) for v in self.history.values()]
        return {"tracked_prompts": float(len(sizes)), "mean_buffer_len": float(np.mean(sizes)) if sizes else 0.0}

    def clear(self) -> None:
        """Forget every prompt's history."""
        self.history.clear()

    def state_dict(self) -> dict:
        return {"history": {prompt: list(buffer) for prompt, buffer in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = {p: deque(v, maxlen=self.buffer_size) for p, v in state["history"].items()}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _estimator(name: str, options: dict) -> AdvantageFn:
    """The registered estimator; unknown names and options are ValueErrors listing what exists."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGES)}")
    fn = ADVANTAGES[name]
    params = list(inspect.signature(fn).parameters.values())[2:]  # after (rewards, groups)
    allowed = [p.name for p in params]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"advantage estimator {name!r} has no option {unknown[0]!r}; its options: {allowed}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in options]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs option {missing[0]!r}")
    return fn


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__

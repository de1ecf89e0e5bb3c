"""Reward functions, registered by name and chosen in config (``reward.name``).

Every reward function has the same batched signature, sync or async:

    fn(images, prompts, metadata) -> (scores, extra_info)

- ``images``: float tensor ``[B, C, H, W]`` (or ``[B, T, C, H, W]`` for video) in [0, 1];
- ``prompts``: ``B`` prompt strings (the user's text, without chat template);
- ``metadata``: ``B`` dicts, each the row's non-tensor columns (``uid``, ``raw_prompt``, ...);
- ``scores``: ``B`` finite floats; ``extra_info``: ``B`` dicts with the same keys in every row
  (logged, and added to the batch as one non-tensor column per key).

A function that raises, or returns a non-finite score, fails the rows it was scoring: see
`flowloop.reward.worker.RewardWorker`. A sync function runs in a worker thread, so it must not
rely on thread-local state.
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[..., object]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``reward.name = <name>``."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REWARDS.get(name)
        if existing is not None and existing is not fn and _qualname(existing) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered to {_qualname(existing)}; pick another name")
        _REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The function registered as ``name``; an unknown name lists the registered ones."""
    if name not in _REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {sorted(_REWARDS)}")
    return _REWARDS[name]


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def _qualname(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

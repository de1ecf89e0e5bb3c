"""Rewards: batched reward functions registered by name, and the streaming `RewardWorker`."""

from flowloop.reward import shapes  # noqa: F401  (registers the "shapes" reward)
from flowloop.reward.registry import get_reward, register_reward, registered_rewards
from flowloop.reward.worker import ERROR_KEY, RewardResult, RewardSample, RewardWorker

__all__ = [
    "ERROR_KEY",
    "RewardResult",
    "RewardSample",
    "RewardWorker",
    "get_reward",
    "register_reward",
    "registered_rewards",
]

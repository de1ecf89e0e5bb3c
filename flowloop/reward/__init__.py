"""Rewards: batched reward functions registered by name, and the streaming `RewardWorker`.

Built in: ``shapes`` and ``shapes_exact`` (the shapes world's verifier), ``jpeg_compressibility``
and ``jpeg_incompressibility``, ``ocr`` (Tesseract against the prompt's quoted text),
``clip_score``, ``pickscore`` and ``aesthetic`` (CLIP models from local folders), ``per_frame``
(an image reward over video frames), ``combined`` (a weighted sum of others), ``by_data_source``
(each row by the reward its ``data_source`` names) and ``remote`` (a reward hosted by
`flowloop serve-reward`). See `flowloop.reward.registry` for how one is chosen and built.
"""

from flowloop.reward import clip_scorers, combine, compression, ocr, remote, route, shapes, video  # noqa: F401  (register the built-in rewards)
from flowloop.reward.registry import build_reward, get_reward, register_reward, registered_rewards
from flowloop.reward.worker import ERROR_KEY, RewardResult, RewardSample, RewardWorker

__all__ = [
    "ERROR_KEY",
    "RewardResult",
    "RewardSample",
    "RewardWorker",
    "build_reward",
    "get_reward",
    "register_reward",
    "registered_rewards",
]

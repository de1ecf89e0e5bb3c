"""The shapes world's verifiable reward: the fraction of the prompt's constraints the image meets."""

from __future__ import annotations

from flowloop.reward.registry import register_reward
from flowloop.tasks import shapes


@register_reward("shapes")
def shapes_reward(images, prompts: list[str], metadata: list[dict]) -> tuple[list[float], list[dict]]:
    """`shapes.verify` per image: ``score`` is the reward; ``correct`` (every constraint met, the
    GenEval-style accuracy) and ``constraints`` (``{constraint: met}``) are the extra info."""
    verdicts = shapes.verify_batch(images, prompts)
    extra = [{"correct": v.correct, "constraints": v.details["constraints"]} for v in verdicts]
    return [v.score for v in verdicts], extra

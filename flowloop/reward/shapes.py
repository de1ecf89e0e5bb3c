"""The shapes world's verifiable rewards: the fraction of the prompt's constraints the image meets.

``shapes`` is the plain verifier score. ``shapes_exact`` adds one constraint the GenEval-style
check leaves out: the picture holds exactly the objects the prompt asks for, no surplus.
"a red circle and a blue square" is met by a picture full of red circles and blue squares, so a
policy trained on ``shapes`` learns to draw more objects, which then breaks counting prompts;
``shapes_exact`` takes that shortcut away. Held-out accuracy is measured with the GenEval-style
verifier whichever reward trains.
"""

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


@register_reward("shapes_exact")
def shapes_exact_reward(images, prompts: list[str], metadata: list[dict]) -> tuple[list[float], list[dict]]:
    """``shapes`` with one more constraint, "no objects beyond those asked for": the score is
    (constraints met + [object count == requested count]) / (constraints + 1)."""
    verdicts = shapes.verify_batch(images, prompts)
    scores, extra = [], []
    for verdict, prompt in zip(verdicts, prompts):
        requested = sum(group.count for group in shapes.parse_prompt(prompt).groups)
        seen = len(verdict.details["objects"])
        constraints = verdict.details["constraints"]
        met = sum(constraints.values()) + (seen == requested)
        scores.append(met / (len(constraints) + 1))
        extra.append({"correct": verdict.correct, "constraints": constraints, "surplus_objects": seen - requested})
    return scores, extra

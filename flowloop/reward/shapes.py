"""The shapes world's verifiable rewards: the fraction of the prompt's constraints the image meets.

``shapes`` is the plain verifier score. ``shapes_exact`` adds one constraint the GenEval-style
check leaves out: the picture holds exactly the objects the prompt asks for, no surplus.
"a red circle and a blue square" is met by a picture full of red circles and blue squares, so a
policy trained on ``shapes`` learns to draw more objects, which then breaks counting prompts;
``shapes_exact`` takes that shortcut away; it is `Verdict.strict`, the strict held-out metric, as a
reward. Held-out accuracy is measured by the verifier (GenEval-style and strict) whichever reward
trains.
"""

from __future__ import annotations

from flowloop.reward.registry import register_reward
from flowloop.tasks import shapes


def blend(fraction_met: float, correct: bool, correct_weight: float) -> float:
    """``(1 - w) * fraction_met + w * correct``: w = 0 is dense partial credit, w = 1 the binary
    GenEval-style accuracy. Partial credit lets a group that never gets a prompt fully right still
    learn; the binary term ranks a fully right picture above one that misses a single constraint
    by more than 1/constraints."""
    if not 0.0 <= correct_weight <= 1.0:
        raise ValueError(f"reward.kwargs.correct_weight must be in [0, 1], got {correct_weight}")
    return (1.0 - correct_weight) * fraction_met + correct_weight * float(correct)


@register_reward("shapes")
def shapes_reward(
    images, prompts: list[str], metadata: list[dict], correct_weight: float = 0.0
) -> tuple[list[float], list[dict]]:
    """`shapes.verify` per image, blended by `blend`; ``correct`` (every constraint met, the
    GenEval-style accuracy) and ``constraints`` (``{constraint: met}``) are the extra info."""
    verdicts = shapes.verify_batch(images, prompts)
    extra = [{"correct": v.correct, "constraints": v.details["constraints"]} for v in verdicts]
    return [blend(v.score, v.correct, correct_weight) for v in verdicts], extra


@register_reward("shapes_exact")
def shapes_exact_reward(
    images, prompts: list[str], metadata: list[dict], correct_weight: float = 0.0
) -> tuple[list[float], list[dict]]:
    """``shapes`` with one more constraint, "no objects beyond those asked for": the fraction is
    (constraints met + [object count == requested count]) / (constraints + 1), and "correct"
    also needs the exact count; both blended by `blend`."""
    verdicts = shapes.verify_batch(images, prompts)
    scores, extra = [], []
    for verdict in verdicts:
        constraints = verdict.details["constraints"]
        met = sum(constraints.values()) + verdict.exact_count
        scores.append(blend(met / (len(constraints) + 1), verdict.strict, correct_weight))
        extra.append({"correct": verdict.correct, "constraints": constraints, "surplus_objects": verdict.surplus_objects})
    return scores, extra

"""The constraints a Spec puts on a set of objects, checked symbolically.

The verifier calls this on objects read back from pixels; the scene sampler calls it on the
objects it places, so both agree on what a prompt means. An object here is anything with
`shape`, `colour` and `centre` ((x, y) in [0, 1], y growing downward).

One constraint per object group, one more for a relation, and for each coloured group a relaxed
twin that ignores colour ("a red circle" also yields "a circle (any colour)"). The twin is
implied by its group, so a correct picture meets every constraint, while a picture with the right
shapes in the wrong colours earns partial credit: the reward is denser than pass/fail.
"""

from collections.abc import Sequence

from .spec import Spec
from .vocab import NUMBER_WORDS, PLURALS

RELATION_MARGIN = 0.03
"""Normalised centroid offset a relation needs in the verifier (about 1 px at 32x32)."""


def relation_holds(
    p: tuple[float, float], q: tuple[float, float], relation: str, margin: float, dominant: bool = False
) -> bool:
    """Whether centre `p` is `relation` centre `q` by more than `margin`.

    With `dominant`, the offset along the relation's axis must also be at least the offset
    across it, so "left of" does not look like "above" (the scene sampler asks for this).
    """
    dx, dy = q[0] - p[0], q[1] - p[1]  # > 0 when p is left of / above q
    main, across = {
        "to the left of": (dx, dy),
        "to the right of": (-dx, dy),
        "above": (dy, dx),
        "below": (-dy, dx),
    }[relation]
    return main > margin and (not dominant or main >= abs(across))


def check(
    objects: Sequence, spec: Spec, margin: float = RELATION_MARGIN, dominant: bool = False
) -> list[tuple[str, bool]]:
    """Every constraint of `spec` on `objects`, as (readable name, met) pairs in a fixed order."""
    results: list[tuple[str, bool]] = []
    matches = []
    for group in spec.groups:
        found = [o for o in objects if group.matches(o.shape, o.colour)]
        matches.append(found)
        if group.colour is not None:
            same_shape = sum(o.shape == group.shape for o in objects)
            results.append((_any_colour_name(group.count, group.shape), same_shape >= group.count))
        met = len(found) == group.count if group.exact else len(found) >= 1
        results.append((group.text(), met))
    if spec.relation is not None:
        met = any(
            a is not b and relation_holds(a.centre, b.centre, spec.relation, margin, dominant)
            for a in matches[0]
            for b in matches[1]
        )
        results.append((spec.text(), met))
    return _unique_names(results)


def _any_colour_name(count: int, shape: str) -> str:
    if count == 1:
        return f"a {shape} (any colour)"
    return f"at least {NUMBER_WORDS[count]} {PLURALS[shape]} (any colour)"


def _unique_names(results: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Suffix repeated names ("a circle and a circle") so they can key a dict."""
    seen: dict[str, int] = {}
    out = []
    for name, met in results:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name} [{seen[name]}]", met))
    return out

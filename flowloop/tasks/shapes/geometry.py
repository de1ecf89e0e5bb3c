"""The outline of every shape, in one place: the renderer draws it, the verifier's templates match it.

A shape is drawn at a `size` (its half-extent, normalised) around its area centroid, so that a
relation between two objects ("above", "left of") compares where they visibly are. Outlines here
are at size 1 with the centroid at the origin and y growing downward; `None` is the circle.

Why these outlines: each must stay itself when a 12-pixel version is anti-aliased, blurred or
noisy, so the star is a fat five-pointed one (inner radius half the outer), the cross has arms
0.45 of its width, and the diamond is a square standing on a corner (half-diagonal 1, so it is
not just a rotated copy of the square's footprint).
"""

import math

import numpy as np

STAR_INNER = 0.5
"""Inner radius of the star over its outer one: 0.38 is the classic star, too thin at 12 px."""
CROSS_ARM = 0.45
"""Width of the cross's arms over its full width."""


def _star() -> np.ndarray:
    angles = [-math.pi / 2 + k * math.pi / 5 for k in range(10)]
    return np.array([(r * math.cos(a), r * math.sin(a)) for a, r in zip(angles, [1.0, STAR_INNER] * 5)])


def _cross() -> np.ndarray:
    a = CROSS_ARM
    half = [(-a, -1), (a, -1), (a, -a), (1, -a), (1, a), (a, a), (a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a), (-a, -a)]
    return np.array(half, dtype=float)


OUTLINES: dict[str, np.ndarray | None] = {
    "circle": None,
    "square": np.array([(-1, -1), (1, -1), (1, 1), (-1, 1)], dtype=float),
    # Apex up, base = height = 2; the centroid lies 2/3 of the way down from the apex.
    "triangle": np.array([(0, -4 / 3), (1, 2 / 3), (-1, 2 / 3)], dtype=float),
    "diamond": np.array([(0, -1), (1, 0), (0, 1), (-1, 0)], dtype=float),
    "cross": _cross(),
    "star": _star(),
}
"""Vertices `[V, 2]` at size 1 around the area centroid (every one here is symmetric about it but
the triangle's); the circle (None) has radius 1."""


def area(shape: str) -> float:
    """Area at size 1 (shoelace formula; pi for the circle)."""
    outline = OUTLINES[shape]
    if outline is None:
        return math.pi
    x, y = outline[:, 0], outline[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def extent(shape: str) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of the shape at size 1 around its centroid."""
    outline = OUTLINES[shape]
    if outline is None:
        return (-1.0, -1.0, 1.0, 1.0)
    (x0, y0), (x1, y1) = outline.min(axis=0), outline.max(axis=0)
    return (float(x0), float(y0), float(x1), float(y1))


def radius(shape: str) -> float:
    """Farthest point of the outline from the centroid, at size 1."""
    outline = OUTLINES[shape]
    return 1.0 if outline is None else float(np.hypot(outline[:, 0], outline[:, 1]).max())


def inside(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Whether points (x, y), in units of the size around the centroid, fall inside the shape
    (even-odd rule over the outline's edges); `x` and `y` broadcast against each other."""
    outline = OUTLINES[shape]
    if outline is None:
        return x**2 + y**2 <= 1.0
    result = np.zeros(np.broadcast_shapes(np.shape(x), np.shape(y)), dtype=bool)
    for (xa, ya), (xb, yb) in zip(outline, np.roll(outline, -1, axis=0)):
        if ya == yb:
            continue  # a horizontal edge never crosses a horizontal ray
        crosses = (ya > y) != (yb > y)
        x_at = xa + (y - ya) * (xb - xa) / (yb - ya)
        result ^= crosses & (x < x_at)
    return result

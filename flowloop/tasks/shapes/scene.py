"""Random scenes that satisfy a prompt: which objects, what colours, where, how big.

Coordinates are normalised to [0, 1] with y growing downward. A layout is built for a nominal
`canvas` (32 px, what the embedded model trains on): objects keep `GAP_PX` pixels apart and
`EDGE_PX` from the border there, so each one stays its own connected component for the verifier.
"""

from dataclasses import dataclass

import numpy as np

from . import geometry
from .constraints import check
from .prompts import CATEGORIES, SPLITS, all_prompts, category_of, parse_prompt, split_prompts, train_colours
from .spec import Spec
from .vocab import COLOURS

# Half-extent (circle radius, half of a square's side, half of a triangle's base and height, a
# star's outer radius; see geometry.py) ranges, normalised. The smallest is 8 px across at 32x32,
# enough for the verifier to tell all six shapes apart (benchmarks/verifier.py).
SIZE_RANGES: tuple[tuple[float, float], ...] = ((0.125, 0.145), (0.16, 0.18), (0.2, 0.23))
GAP_PX = 3
EDGE_PX = 1
RELATION_CLEARANCE = 0.2
"""Centroid offset a sampled scene gives a relation, along its axis (which must dominate)."""

RANDOM_LAYOUT_MAX = 4
"""Scenes with more objects than this are laid out on a grid (random spots rarely fit them)."""

_ATTRIBUTE_TRIES = 200
_LAYOUT_TRIES = 300
_POSITION_TRIES = 60
_COLOUR_NAMES = list(COLOURS)


@dataclass(frozen=True)
class SceneObject:
    """One shape. `centre` is its area centroid (for a triangle, 2/3 of the way down)."""

    shape: str
    colour: str
    centre: tuple[float, float]
    size: float

    def bbox(self) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) of the outline (`geometry.OUTLINES`) at `size` around `centre`; a
        triangle points up, base and height 2*size, so its box reaches 4/3 size above the centre."""
        x, y = self.centre
        x0, y0, x1, y1 = geometry.extent(self.shape)
        return (x + x0 * self.size, y + y0 * self.size, x + x1 * self.size, y + y1 * self.size)


@dataclass(frozen=True)
class Scene:
    """A layout satisfying `spec`; `category` is None for prompts outside the six templates."""

    category: str | None
    spec: Spec
    objects: tuple[SceneObject, ...]
    canvas: int = 32

    @property
    def prompt(self) -> str:
        return self.spec.text()


def sample_scene(rng: np.random.Generator, category: str | None = None, split: str | None = None) -> Scene:
    """A random scene: a category (uniform if None), one of its prompts (uniform, from `split`
    when given), and a layout satisfying it."""
    _check_rng(rng)
    if category is None:
        category = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
    prompts = all_prompts(category) if split is None else split_prompts(split, category)
    return scene_for(parse_prompt(prompts[int(rng.integers(len(prompts)))]), rng, split=split)


def scene_for(spec: Spec, rng: np.random.Generator, canvas: int = 32, split: str | None = None) -> Scene:
    """A random scene satisfying any parsed `spec`; ValueError if none is found in bounded tries.

    With `split="train"`, an object whose colour the prompt leaves free ("a star") only takes a
    colour the train split pairs with its shape (`train_colours`), so a train picture never shows
    a held-out composition the prompt did not ask for.
    """
    _check_rng(rng)
    if not isinstance(canvas, int) or canvas < 16:
        raise ValueError(f"canvas must be an int >= 16 (pixels), got {canvas!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be None or one of {list(SPLITS)}, got {split!r}")
    items = _choose_attributes(spec, rng, split)
    objects = _lay_out(items, spec, rng, canvas)
    return Scene(category_of(spec), spec, objects, canvas)


def _choose_attributes(spec: Spec, rng: np.random.Generator, split: str | None) -> list[tuple[str, str]]:
    """(shape, colour) per object: exact groups first, then one object per "a" group unless
    objects already placed satisfy it; retried with fresh colours until every count holds."""
    counts_only = Spec(spec.groups)
    order = sorted(range(len(spec.groups)), key=lambda k: not spec.groups[k].exact)
    for _ in range(_ATTRIBUTE_TRIES):
        items: list[tuple[str, str]] = []
        for k in order:
            group = spec.groups[k]
            found = [i for i, item in enumerate(items) if group.matches(*item)]
            if group.exact:
                need = group.count - len(found)
            else:
                need = 0 if found and _pair_available(spec, k, items) else 1
            items += [(group.shape, group.colour or _free_colour(group.shape, rng, split)) for _ in range(max(need, 0))]
        placed = [SceneObject(shape, colour, (0.5, 0.5), 0.0) for shape, colour in items]
        if all(met for _, met in check(placed, counts_only)):
            return items
    raise ValueError(f"cannot choose objects for {spec.text()!r}: its counts contradict each other")


def _pair_available(spec: Spec, k: int, items: list[tuple[str, str]]) -> bool:
    """Whether existing items already give group k a partner object for the relation, if any."""
    if spec.relation is None:
        return True
    mine = {i for i, item in enumerate(items) if spec.groups[k].matches(*item)}
    other = {i for i, item in enumerate(items) if spec.groups[1 - k].matches(*item)}
    return any(a != b for a in mine for b in other)


def _free_colour(shape: str, rng: np.random.Generator, split: str | None) -> str:
    colours = train_colours(shape) if split == "train" else _COLOUR_NAMES
    return colours[int(rng.integers(len(colours)))]


def _lay_out(
    items: list[tuple[str, str]], spec: Spec, rng: np.random.Generator, canvas: int
) -> tuple[SceneObject, ...]:
    """Positions and sizes until every constraint holds with the relation clearly visible.

    Up to `RANDOM_LAYOUT_MAX` objects go to random free spots, restarting when stuck; later
    restarts draw from smaller size ranges. Crowded prompts (or a random layout that kept
    failing) go to one object per cell of a square grid, as big as the cells allow.
    """
    gap, edge = GAP_PX / canvas, EDGE_PX / canvas
    if len(items) <= RANDOM_LAYOUT_MAX:
        for attempt in range(_LAYOUT_TRIES):
            n_ranges = len(SIZE_RANGES) - attempt * len(SIZE_RANGES) // _LAYOUT_TRIES
            objects = _random_layout(items, rng, SIZE_RANGES[:n_ranges], gap, edge)
            if objects is not None and _clearly_satisfies(objects, spec):
                return objects
    for _ in range(_LAYOUT_TRIES):
        objects = _grid_layout(items, rng, gap, edge)
        if objects is not None and _clearly_satisfies(objects, spec):
            return objects
    raise ValueError(f"could not lay out {len(items)} objects for {spec.text()!r} in {_LAYOUT_TRIES} tries")


def _clearly_satisfies(objects: tuple[SceneObject, ...], spec: Spec) -> bool:
    return all(met for _, met in check(objects, spec, margin=RELATION_CLEARANCE, dominant=True))


def _random_layout(items, rng, size_ranges, gap, edge) -> tuple[SceneObject, ...] | None:
    objects: list[SceneObject] = []
    for shape, colour in items:
        obj = _place_one(shape, colour, objects, rng, size_ranges, gap, edge)
        if obj is None:
            return None
        objects.append(obj)
    return tuple(objects)


def _grid_layout(items, rng, gap, edge) -> tuple[SceneObject, ...] | None:
    """Objects in random distinct cells of a k x k grid; cells are inset by gap/2, so any two
    objects keep `gap` apart and the outer ones `edge` from the border."""
    k = int(np.ceil(np.sqrt(len(items))))
    cell = (1 - 2 * edge + gap) / k
    inner = cell - gap
    if inner / 2 < SIZE_RANGES[0][0] * 0.9:  # 9 objects on a 32 px canvas still fit
        return None
    cells = rng.permutation(k * k)[: len(items)]
    objects = []
    for (shape, colour), index in zip(items, cells.tolist()):
        size = float(rng.uniform(0.95, 1.0)) * inner / 2
        x0, y0, x1, y1 = geometry.extent(shape)  # within [-1, 1]: the object fits a 2*size box
        left = edge + (index % k) * cell + rng.uniform(0, inner - (x1 - x0) * size)
        top = edge + (index // k) * cell + rng.uniform(0, inner - (y1 - y0) * size)
        objects.append(SceneObject(shape, colour, (float(left - x0 * size), float(top - y0 * size)), size))
    return tuple(objects)


def _place_one(shape, colour, placed, rng, size_ranges, gap, edge) -> SceneObject | None:
    low, high = size_ranges[int(rng.integers(len(size_ranges)))]
    size = float(rng.uniform(low, high))
    probe = SceneObject(shape, colour, (0.0, 0.0), size).bbox()  # extents around the centre
    for _ in range(_POSITION_TRIES):
        x = rng.uniform(edge - probe[0], 1 - edge - probe[2])
        y = rng.uniform(edge - probe[1], 1 - edge - probe[3])
        obj = SceneObject(shape, colour, (float(x), float(y)), size)
        if all(_apart(obj.bbox(), other.bbox(), gap) for other in placed):
            return obj
    return None


def _apart(a, b, gap: float) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _check_rng(rng) -> None:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {type(rng).__name__}"
        )

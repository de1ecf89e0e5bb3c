"""The prompt grammar: parsing, the six GenEval-like categories, and the fixed train/held-out split.

Grammar (words from `vocab.VOCABULARY`, case and spacing free, a trailing period allowed):

    prompt   := phrase | phrase "and" phrase | phrase RELATION phrase
    phrase   := ("a" | "an" | "one" | "two" | "three" | "four") [COLOUR] (SHAPE | SHAPE "s")

"a"/"an"/"one" take the singular noun, "two".."four" the plural; a mismatch ("two circle") is
rejected rather than guessed. "a" and "an" are interchangeable. The samplers only produce the
six category templates, but any prompt of the grammar parses and can be rendered and verified.

Categories (templates; `category_of` maps a Spec back to its category):

    single_object  {a, one} [colour] shape               "a star", "one red star"
    two_objects    {a, two} shape and {a, two} shape     "a circle and two crosses"
    counting       {two, three, four} [colour] shapes    "three stars", "four pink squares"
    colors         a colour shape and a colour shape     "a red star and a blue star" (one shape)
    position       a shape RELATION a shape              "a circle above a diamond"
    color_attr     a colour shape and a colour shape     "a red star and a blue square"

GenEval's single-object, two-object, counting and colour templates have one variant each; here
each is widened by a count word or a colour so that every category has at least 30 held-out
prompts made of held-out compositions. "colors" asks for one shape in two colours, so the shape
cannot give the colours away; a single coloured object ("a red star") is a single_object prompt.

The split is by composition, not by sentence. `HELDOUT_COLOUR_SHAPES` (18 of the 54 colour-shape
pairs: three colours per shape, two shapes per colour) and `HELDOUT_SHAPE_PAIRS` (5 of the 15
shape pairs) are never shown together in a train-split prompt, and `train_colours` keeps them
apart where a prompt leaves the colour free, so no pretraining picture has a red square. Every
word, and every shape and colour with most partners, still appears in training.
"""

import hashlib
import itertools
from functools import lru_cache

from .spec import ObjectGroup, Spec
from .vocab import ARTICLES, COLOURS, CONJUNCTION, NUMBERS, PLURALS, RELATIONS, SHAPES, VOCABULARY

CATEGORIES: tuple[str, ...] = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
SPLITS: tuple[str, ...] = ("train", "heldout")
HELDOUT_COLOUR_SHAPES: frozenset[tuple[str, str]] = frozenset(
    (colour, shape)
    for shape, colours in {
        "circle": ("orange", "blue", "pink"),
        "square": ("red", "purple", "cyan"),
        "triangle": ("yellow", "green", "black"),
        "star": ("red", "blue", "black"),
        "diamond": ("orange", "green", "purple"),
        "cross": ("yellow", "pink", "cyan"),
    }.items()
    for colour in colours
)
"""(colour, shape) pairs no train-split picture shows."""
HELDOUT_SHAPE_PAIRS: frozenset[frozenset[str]] = frozenset(
    frozenset(pair)
    for pair in [("circle", "triangle"), ("square", "diamond"), ("star", "cross"), ("circle", "star"), ("triangle", "cross")]
)
"""Shape pairs no train-split picture shows together (old and old, old and new, new and new)."""
HELDOUT_PER_CATEGORY = 48
"""Held-out prompts kept per category: the colour categories have hundreds of candidates, and
`flowloop eval` scores every held-out prompt at several seeds."""
_SPLIT_SALT = "flowloop-shapes-split-v2"  # changing it changes which candidates are held out: do not.
_SINGULARS = {plural: shape for shape, plural in PLURALS.items()}


def parse_prompt(text: str) -> Spec:
    """Parse a prompt of the grammar into a `Spec`; raises ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"prompt must be a str, got {type(text).__name__}")
    words = text.strip().lower().rstrip(".").split()
    if not words:
        raise ValueError(f"prompt is empty: {text!r}; expected e.g. 'a red circle'")
    for word in words:
        if word not in VOCABULARY:
            raise ValueError(f"unknown word {word!r} in prompt {text!r}; allowed words: {', '.join(VOCABULARY)}")

    first, i = _parse_phrase(words, 0, text)
    if i == len(words):
        return Spec((first,))
    joiner, i = _parse_joiner(words, i, text)
    second, i = _parse_phrase(words, i, text)
    if i != len(words):
        raise ValueError(f"expected the end of prompt {text!r} after {second.text()!r}, got {' '.join(words[i:])!r}")
    return Spec((first, second), relation=None if joiner == CONJUNCTION else joiner)


def _parse_phrase(words: list[str], i: int, text: str) -> tuple[ObjectGroup, int]:
    """Read `determiner [colour] noun` starting at words[i]; return the group and the next index."""
    determiners = [*ARTICLES, *NUMBERS]
    if i >= len(words) or words[i] not in determiners:
        got = repr(words[i]) if i < len(words) else "the end"
        raise ValueError(f"expected one of {determiners} at word {i + 1} of {text!r}, got {got}")
    determiner, i = words[i], i + 1
    colour = None
    if i < len(words) and words[i] in COLOURS:
        colour, i = words[i], i + 1
    if i >= len(words) or (words[i] not in SHAPES and words[i] not in _SINGULARS):
        got = repr(words[i]) if i < len(words) else "the end"
        raise ValueError(f"expected a shape ({', '.join(SHAPES)} or plural) after {determiner!r} in {text!r}, got {got}")
    noun, i = words[i], i + 1

    exact = determiner not in ARTICLES
    count = NUMBERS.get(determiner, 1)
    shape = _SINGULARS.get(noun, noun)
    wanted = PLURALS[shape] if count > 1 else shape
    if noun != wanted:
        raise ValueError(f"{determiner!r} needs {wanted!r}, got {noun!r} in {text!r}")
    return ObjectGroup(count, exact, shape, colour), i


def _parse_joiner(words: list[str], i: int, text: str) -> tuple[str, int]:
    """Read "and" or a relation phrase at words[i]; return it and the next index."""
    for joiner in (CONJUNCTION, *RELATIONS):
        n = len(joiner.split())
        if " ".join(words[i : i + n]) == joiner:
            return joiner, i + n
    raise ValueError(f"expected 'and' or a relation {list(RELATIONS)} at word {i + 1} of {text!r}, got {words[i]!r}")


def prompt_for(scene) -> str:
    """The prompt text of a `Scene` (the canonical text of its spec)."""
    return scene.spec.text()


def category_of(spec: Spec) -> str | None:
    """The category whose template produces `spec`, or None for other prompts of the grammar."""
    groups, relation = spec.groups, spec.relation
    if len(groups) == 1:
        return "single_object" if groups[0].count == 1 else "counting"
    a, b = groups
    if relation is not None:
        plain = not (a.exact or b.exact or a.colour or b.colour)
        return "position" if plain and a.shape != b.shape else None
    if a.colour is None and b.colour is None:
        some_or_two = all((g.count, g.exact) in ((1, False), (2, True)) for g in groups)
        return "two_objects" if some_or_two and a.shape != b.shape else None
    if a.exact or b.exact or a.colour is None or b.colour is None or a.colour == b.colour:
        return None
    return "colors" if a.shape == b.shape else "color_attr"


def is_heldout_composition(spec: Spec) -> bool:
    """Whether `spec` puts together words that no train-split picture shows together: a
    (colour, shape) pair of `HELDOUT_COLOUR_SHAPES`, or two shapes of `HELDOUT_SHAPE_PAIRS`."""
    coloured = any((g.colour, g.shape) in HELDOUT_COLOUR_SHAPES for g in spec.groups if g.colour)
    shapes = frozenset(g.shape for g in spec.groups)
    return coloured or (len(shapes) == 2 and shapes in HELDOUT_SHAPE_PAIRS)


def train_colours(shape: str) -> list[str]:
    """The colours a train-split picture may give `shape` (for objects whose colour is free)."""
    return [c for c in COLOURS if (c, shape) not in HELDOUT_COLOUR_SHAPES]


@lru_cache(maxsize=None)
def _category_specs(category: str) -> tuple[Spec, ...]:
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {list(CATEGORIES)}, got {category!r}")
    some = lambda shape, colour=None: ObjectGroup(1, False, shape, colour)  # noqa: E731
    shape_pairs = list(itertools.permutations(SHAPES, 2))
    colour_pairs = list(itertools.permutations(COLOURS, 2))
    tinted = [None, *COLOURS]  # no colour, then each colour
    if category == "single_object":
        return tuple(Spec((ObjectGroup(1, exact, s, c),)) for c in tinted for exact in (False, True) for s in SHAPES)
    if category == "two_objects":
        def group(n, shape):  # "a" (at least one) or "two" (exactly two)
            return ObjectGroup(n, n == 2, shape)

        counts = [(1, 1), (1, 2), (2, 1), (2, 2)]
        return tuple(Spec((group(m, a), group(n, b))) for m, n in counts for a, b in shape_pairs)
    if category == "counting":
        return tuple(Spec((ObjectGroup(n, True, s, c),)) for c in tinted for n in (2, 3, 4) for s in SHAPES)
    if category == "colors":
        return tuple(Spec((some(s, c1), some(s, c2))) for s in SHAPES for c1, c2 in colour_pairs)
    if category == "position":
        return tuple(Spec((some(a), some(b)), r) for r in RELATIONS for a, b in shape_pairs)
    return tuple(Spec((some(s1, c1), some(s2, c2))) for s1, s2 in shape_pairs for c1, c2 in colour_pairs)


def all_prompts(category: str) -> list[str]:
    """Every prompt of `category`'s template, in a fixed order."""
    return [spec.text() for spec in _category_specs(category)]


@lru_cache(maxsize=None)
def _split(category: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # Held-out candidates are ranked by a salted sha256 of the text: stable across runs,
    # platforms and Python versions, and independent of the enumeration order above.
    specs = _category_specs(category)
    train = tuple(spec.text() for spec in specs if not is_heldout_composition(spec))
    candidates = [spec.text() for spec in specs if is_heldout_composition(spec)]
    ranked = sorted(candidates, key=lambda p: hashlib.sha256(f"{_SPLIT_SALT}:{p}".encode()).hexdigest())
    chosen = set(ranked[:HELDOUT_PER_CATEGORY])
    return train, tuple(p for p in candidates if p in chosen)


def split_prompts(split: str, category: str | None = None) -> list[str]:
    """The fixed split's prompts (of one category, or of all in CATEGORIES order), in template order.

    train: every prompt of the templates with no held-out composition. heldout: prompts that
    have one (so they show words together that training never did), at most
    `HELDOUT_PER_CATEGORY` per category, chosen by a salted hash.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    categories = CATEGORIES if category is None else (category,)
    return [p for c in categories for p in _split(c)[SPLITS.index(split)]]

"""The prompt grammar: parsing, the six GenEval-like categories, and the fixed train/held-out split.

Grammar (words from `vocab.VOCABULARY`, case and spacing free, a trailing period allowed):

    prompt   := phrase | phrase "and" phrase | phrase RELATION phrase
    phrase   := ("a" | "an" | "one" | "two" | "three" | "four") [COLOUR] (SHAPE | SHAPE "s")

"a"/"an"/"one" take the singular noun, "two".."four" the plural; a mismatch ("two circle") is
rejected rather than guessed. "a" and "an" are interchangeable. The samplers only produce the
six category templates, but any prompt of the grammar parses and can be rendered and verified.
"""

import hashlib
import itertools
from functools import lru_cache

from .spec import ObjectGroup, Spec
from .vocab import ARTICLES, COLOURS, CONJUNCTION, NUMBERS, PLURALS, RELATIONS, SHAPES, VOCABULARY

CATEGORIES: tuple[str, ...] = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
SPLITS: tuple[str, ...] = ("train", "heldout")
HELDOUT_FRACTION = 0.25
_SPLIT_SALT = "flowloop-shapes-split-v1"  # changing it changes every split: do not.
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
        (g,) = groups
        if g.exact:
            return "counting" if g.count > 1 and g.colour is None else None
        return "colors" if g.colour else "single_object"
    a, b = groups
    if a.exact or b.exact or a.shape == b.shape:
        return None
    if a.colour is None and b.colour is None:
        return "position" if relation else "two_objects"
    if relation is None and a.colour and b.colour and a.colour != b.colour:
        return "color_attr"
    return None


@lru_cache(maxsize=None)
def _category_specs(category: str) -> tuple[Spec, ...]:
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {list(CATEGORIES)}, got {category!r}")
    some = lambda shape, colour=None: ObjectGroup(1, False, shape, colour)  # noqa: E731
    shape_pairs = list(itertools.permutations(SHAPES, 2))
    if category == "single_object":
        return tuple(Spec((some(s),)) for s in SHAPES)
    if category == "two_objects":
        return tuple(Spec((some(a), some(b))) for a, b in shape_pairs)
    if category == "counting":
        return tuple(Spec((ObjectGroup(n, True, s),)) for s in SHAPES for n in (2, 3, 4))
    if category == "colors":
        return tuple(Spec((some(s, c),)) for c in COLOURS for s in SHAPES)
    if category == "position":
        return tuple(Spec((some(a), some(b)), r) for r in RELATIONS for a, b in shape_pairs)
    colour_pairs = list(itertools.permutations(COLOURS, 2))
    return tuple(Spec((some(s1, c1), some(s2, c2))) for c1, c2 in colour_pairs for s1, s2 in shape_pairs)


def all_prompts(category: str) -> list[str]:
    """Every prompt of `category`'s template, in a fixed order."""
    return [spec.text() for spec in _category_specs(category)]


@lru_cache(maxsize=None)
def _heldout(category: str) -> frozenset[str]:
    # Rank by a salted sha256 of the text: stable across runs, platforms and Python versions,
    # and independent of the enumeration order above.
    prompts = all_prompts(category)
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(f"{_SPLIT_SALT}:{p}".encode()).hexdigest())
    n_heldout = max(1, int(len(prompts) * HELDOUT_FRACTION + 0.5))
    return frozenset(ranked[:n_heldout])


def split_prompts(split: str, category: str | None = None) -> list[str]:
    """The fixed split's prompts (of one category, or of all in CATEGORIES order).

    Per category, round(25%) of the prompts (at least one) are held out, so held-out accuracy
    measures composition of words that were all seen in training, in unseen combinations.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    categories = CATEGORIES if category is None else (category,)
    want_heldout = split == "heldout"
    return [p for c in categories for p in all_prompts(c) if (p in _heldout(c)) == want_heldout]

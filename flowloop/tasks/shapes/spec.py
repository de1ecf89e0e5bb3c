"""What a prompt asks for, as data: object groups and an optional relation between two of them.

Semantics, used alike by the scene sampler and the verifier:
- `ObjectGroup(count, exact=True, ...)` ("two red circles"): exactly `count` objects with that
  shape (and that colour, when given) are in the picture.
- `ObjectGroup(1, exact=False, ...)` ("a red circle"): at least one such object.
- `Spec.relation` ("a circle to the left of a square"): some object matching `groups[0]` stands
  in that relation to a different object matching `groups[1]`, judged by centroids.
"""

from dataclasses import dataclass

from .vocab import COLOURS, NUMBER_WORDS, PLURALS, RELATIONS, SHAPES, article_for


@dataclass(frozen=True)
class ObjectGroup:
    """One object phrase: `count` objects of `shape`, of `colour` (None = any colour)."""

    count: int
    exact: bool
    shape: str
    colour: str | None = None

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {list(SHAPES)}, got {self.shape!r}")
        if self.colour is not None and self.colour not in COLOURS:
            raise ValueError(f"colour must be None or one of {list(COLOURS)}, got {self.colour!r}")
        if self.count not in NUMBER_WORDS:
            raise ValueError(f"count must be in {sorted(NUMBER_WORDS)}, got {self.count!r}")
        if not self.exact and self.count != 1:
            raise ValueError(f"a non-exact group ('a'/'an') has count 1, got count={self.count}")

    def text(self) -> str:
        """The object phrase: "a red circle", "an orange square", "two circles", "one square"."""
        noun = PLURALS[self.shape] if self.count > 1 else self.shape
        words = [self.colour, noun] if self.colour else [noun]
        determiner = NUMBER_WORDS[self.count] if self.exact else article_for(words[0])
        return " ".join([determiner, *words])

    def matches(self, shape: str | None, colour: str | None) -> bool:
        """Whether an object of this shape and colour counts towards the group."""
        return shape == self.shape and (self.colour is None or colour == self.colour)


@dataclass(frozen=True)
class Spec:
    """A parsed prompt: one or two object groups; `relation` links groups[0] to groups[1]."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    def __post_init__(self):
        if len(self.groups) not in (1, 2):
            raise ValueError(f"a Spec has 1 or 2 object groups, got {len(self.groups)}")
        if self.relation is not None:
            if self.relation not in RELATIONS:
                raise ValueError(f"relation must be None or one of {list(RELATIONS)}, got {self.relation!r}")
            if len(self.groups) != 2:
                raise ValueError("a relation needs exactly 2 object groups")

    @property
    def object_count(self) -> int:
        """How many objects the prompt asks for: "a square" 1, "two triangles and a circle" 3."""
        return sum(group.count for group in self.groups)

    def text(self) -> str:
        """The canonical prompt: `parse_prompt(spec.text()) == spec`."""
        if len(self.groups) == 1:
            return self.groups[0].text()
        joiner = self.relation or "and"
        return f"{self.groups[0].text()} {joiner} {self.groups[1].text()}"

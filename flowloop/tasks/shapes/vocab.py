"""The words and colours of the shapes world: everything a prompt or a picture may contain.

The palette is chosen for the verifier, not for looks. Each colour is read back as a direction
away from the background (see `readback.py`), so what matters is the angle between those
directions; the closest pairs (red/pink, red/orange, yellow/orange) are 22-23 degrees apart against
the light grey background, which survives anti-aliased edges, blur and pixel noise. Nine colours:
a tenth would come closer (brown is 15 degrees from black, magenta 12 from pink), and white or
grey would be the background.
"""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross")
"""Outlines in `geometry.py`. No hexagon: an area-matched hexagon and circle overlap by 0.955,
so the verifier tells them apart by only 0.02-0.04 of soft IoU at any resolution, and a model's
slightly lumpy circle would read as a hexagon."""
PLURALS: dict[str, str] = {shape: shape + "s" for shape in SHAPES}

# RGB, uint8. Insertion order is the palette index used by the verifier.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 20, 40),
    "orange": (250, 125, 0),
    "yellow": (250, 230, 20),
    "green": (30, 200, 40),
    "blue": (30, 90, 250),
    "purple": (170, 40, 240),
    "pink": (250, 110, 190),
    "cyan": (0, 200, 220),
    "black": (20, 20, 20),
}
BACKGROUND: tuple[int, int, int] = (240, 240, 240)

# Number words: "a"/"an" mean "at least one", the others an exact count.
ARTICLES: tuple[str, ...] = ("a", "an")
NUMBERS: dict[str, int] = {"one": 1, "two": 2, "three": 3, "four": 4}
NUMBER_WORDS: dict[int, str] = {n: word for word, n in NUMBERS.items()}

# Relation phrases, as they appear in prompts; a Spec stores the phrase itself.
RELATIONS: tuple[str, ...] = ("to the left of", "to the right of", "above", "below")
CONJUNCTION = "and"

VOCABULARY: list[str] = list(
    dict.fromkeys(
        [
            *ARTICLES,
            *NUMBERS,
            *COLOURS,
            *SHAPES,
            *PLURALS.values(),
            CONJUNCTION,
            *(word for phrase in RELATIONS for word in phrase.split()),
        ]
    )
)
"""Every word a prompt of the grammar can contain, in a fixed order (for building a tokenizer)."""


def article_for(word: str) -> str:
    """The indefinite article that reads right before `word` ("an orange", "a circle")."""
    return "an" if word[0] in "aeiou" else "a"

"""Draw a Scene as an RGB picture: flat shapes on a plain background, anti-aliased edges."""

import numpy as np
from PIL import Image, ImageDraw

from . import geometry
from .scene import Scene
from .vocab import BACKGROUND, COLOURS

SUPERSAMPLE = 4
"""Draw at SUPERSAMPLE x the size, then box-filter down: edges blend only with the background."""
MIN_SIZE, MAX_SIZE = 16, 2048


def render(scene: Scene, size: int | tuple[int, int] = 64) -> np.ndarray:
    """The scene as uint8 `[size, size, 3]` RGB. `size` is an int or a square (h, w) pair."""
    side = _side(size)
    big = side * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in scene.objects:
        fill = COLOURS[obj.colour]
        outline = geometry.OUTLINES[obj.shape]
        if outline is None:
            draw.ellipse(tuple(v * big for v in obj.bbox()), fill=fill)
        else:  # the outline around the area centroid, at the object's size
            (x, y), size = obj.centre, obj.size
            draw.polygon([((x + size * u) * big, (y + size * v) * big) for u, v in outline], fill=fill)
    return np.array(canvas.resize((side, side), Image.Resampling.BOX), dtype=np.uint8)  # writable copy


def _side(size) -> int:
    if isinstance(size, (tuple, list)):
        if len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"size must be an int or a square (h, w) pair, got {size!r}")
        size = size[0]
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"size must be an int in [{MIN_SIZE}, {MAX_SIZE}] (pixels per side), got {size!r}")
    return int(size)

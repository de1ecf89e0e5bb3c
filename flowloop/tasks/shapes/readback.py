"""Read a picture back into objects: palette colour per pixel, connected components, shape.

1. Each pixel is unmixed against the background: for every palette colour c, how far along the
   line background -> c it lies (`alpha`, its coverage) and how far off that line (`residual`,
   how wrong its hue is). Its hue is the colour with the smallest residual; it shows that colour
   if the colour covers at least half of it and the residual is small, else it is background
   (so are grey, white and muddy pixels). Anti-aliased or blurred edges are thus blends of one
   colour with the background, never a ring of a third colour.
2. Pixels of one colour are joined into 4-connected components (numpy label propagation with
   pointer jumping); components under `MIN_AREA_FRACTION` of the image are noise and dropped.
3. Shape by template: each component's coverage (its pixels plus their partly covered 1-pixel
   rim) is compared with every shape of `geometry.OUTLINES` (circle, square, apex-up triangle,
   star, diamond, cross) at the same area and centroid (soft IoU); the best one wins if it
   overlaps at least `MIN_TEMPLATE_IOU`. Using all pixels and sub-pixel templates keeps 8-pixel
   shapes apart, where bounding-box features (fill ratio) are swamped by one ragged edge: on
   noisy 32 px renders the right template leads the next best by at least 0.07 (cross against
   diamond), most by 0.1-0.25.
"""

from dataclasses import dataclass

import numpy as np

from . import geometry
from .vocab import BACKGROUND, COLOURS, SHAPES

MIN_ALPHA = 0.5
"""Least coverage of its colour for a pixel to belong to an object."""
MAX_ALPHA = 1.6
"""Most coverage: further out than the palette colour (much darker or more saturated) is not it."""
RESIDUAL_CUT = 60.0
"""Largest off-hue distance (uint8 RGB units) at which a pixel still counts as a palette colour."""
MIN_AREA_FRACTION = 0.01
"""Smallest component kept, as a fraction of the image (10 px at 32x32, 41 px at 64x64)."""
MIN_TEMPLATE_IOU = 0.7
"""A component whose best-fitting ideal shape overlaps it less than this is no known shape."""

_COLOUR_NAMES = list(COLOURS)
_REACH = max(geometry.radius(shape) / np.sqrt(geometry.area(shape)) for shape in SHAPES)
"""How far an area-matched template reaches from its centroid, over sqrt(area), at most (a
triangle's apex: 0.943); bounds the window a component is matched in."""
_BG = np.asarray(BACKGROUND, dtype=np.float32)
_DIRS = np.asarray(list(COLOURS.values()), dtype=np.float32) - _BG  # [K, 3]
_DIR_NORM2 = (_DIRS**2).sum(axis=1)  # [K]


@dataclass(frozen=True)
class DetectedObject:
    """A component read back from pixels; `shape` is None when it looks like no known shape."""

    shape: str | None
    colour: str
    centre: tuple[float, float]
    area: int
    overlaps: dict[str, float]

    def to_dict(self) -> dict:
        return {
            "shape": self.shape,
            "colour": self.colour,
            "centre": [round(self.centre[0], 4), round(self.centre[1], 4)],
            "area": self.area,
            "overlaps": {name: round(iou, 3) for name, iou in self.overlaps.items()},
        }


def classify_pixels(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[H, W, 3]` float RGB in 0..255 -> palette index `[H, W]` (-1 background) and coverage
    `[H, W, K]`: how far each pixel lies from the background towards each colour, in [0, 1]."""
    p = rgb.reshape(-1, 3).astype(np.float32) - _BG  # [N, 3]
    dots = p @ _DIRS.T  # [N, K]
    alpha = dots / _DIR_NORM2  # [N, K]
    residual2 = (p**2).sum(axis=1, keepdims=True) - dots * alpha  # [N, K] squared distance to each line
    # Hue first (nearest line on the colour's side of the background), coverage second: choosing
    # among only the colours that cover half the pixel would call a 45%-orange edge "yellow".
    best = np.where(alpha > 0, residual2, np.inf).argmin(axis=1)  # [N]
    rows = np.arange(len(best))
    chosen = alpha[rows, best]  # [N]
    ok = (chosen >= MIN_ALPHA) & (chosen <= MAX_ALPHA) & (residual2[rows, best] <= RESIDUAL_CUT**2)
    classes = np.where(ok, best, -1).reshape(rgb.shape[:2])  # [H, W]
    return classes, np.clip(alpha, 0.0, 1.0).reshape(*rgb.shape[:2], -1)


def label_components(classes: np.ndarray) -> np.ndarray:
    """4-connected components of equal non-negative classes -> `[H, W]` labels (-1 background).

    A label is the smallest flat index in its component. Labels only decrease and always point
    at a pixel of the same component, so `label[label]` (pointer jumping) is a valid shortcut.
    """
    h, w = classes.shape
    fg = classes >= 0
    big = h * w
    labels = np.where(fg, np.arange(big).reshape(h, w), big)
    same_x = fg[:, :-1] & (classes[:, :-1] == classes[:, 1:])  # [H, W-1]
    same_y = fg[:-1, :] & (classes[:-1, :] == classes[1:, :])  # [H-1, W]
    flat_fg = fg.ravel()
    while True:
        new = labels.copy()
        np.minimum(new[:, :-1], np.where(same_x, labels[:, 1:], big), out=new[:, :-1])
        np.minimum(new[:, 1:], np.where(same_x, labels[:, :-1], big), out=new[:, 1:])
        np.minimum(new[:-1, :], np.where(same_y, new[1:, :], big), out=new[:-1, :])
        np.minimum(new[1:, :], np.where(same_y, new[:-1, :], big), out=new[1:, :])
        flat = new.ravel()
        for _ in range(2):
            flat[flat_fg] = flat[flat[flat_fg]]
        if np.array_equal(new, labels):
            return np.where(fg, labels, -1)
        labels = new


def detect_objects(rgb: np.ndarray) -> list[DetectedObject]:
    """`[H, W, 3]` float RGB in 0..255 -> the objects in it, in raster order of their top pixel."""
    h, w = rgb.shape[:2]
    classes, coverage = classify_pixels(rgb)
    labels = label_components(classes)
    ids, areas = np.unique(labels[labels >= 0], return_counts=True)
    min_area = max(4, MIN_AREA_FRACTION * h * w)
    objects = []
    for comp, area in zip(ids[areas >= min_area].tolist(), areas[areas >= min_area].tolist()):
        k = int(classes.flat[comp])
        soft, (x0, y0) = _soft_mask(labels == comp, classes < 0, coverage[..., k])
        total = float(soft.sum())
        cx = float((soft.sum(axis=0) * (np.arange(soft.shape[1]) + 0.5)).sum()) / total + x0
        cy = float((soft.sum(axis=1) * (np.arange(soft.shape[0]) + 0.5)).sum()) / total + y0
        overlaps = template_overlaps(soft, cx - x0, cy - y0)
        best = max(overlaps, key=overlaps.get)
        shape = best if overlaps[best] >= MIN_TEMPLATE_IOU else None
        objects.append(DetectedObject(shape, _COLOUR_NAMES[k], (cx / w, cy / h), area, overlaps))
    return objects


def _soft_mask(
    component: np.ndarray, background: np.ndarray, coverage: np.ndarray
) -> tuple[np.ndarray, tuple[int, int]]:
    """The component's coverage of its colour in a window with room for any fitted template.

    Background pixels just outside the component (its 1-pixel 8-neighbourhood) keep their partial
    coverage, so anti-aliased or blurred edges count for what they are; all other pixels count as
    zero, so neighbouring objects do not leak in. Returns the window and its (x0, y0).
    """
    h, w = component.shape
    ys, xs = np.nonzero(component)
    reach = int(np.ceil(_REACH * np.sqrt(len(xs)))) + 2
    x0, x1 = max(0, xs.min() - reach), min(w, xs.max() + reach + 1)
    y0, y1 = max(0, ys.min() - reach), min(h, ys.max() + reach + 1)
    grown = component[y0:y1, x0:x1].copy()  # [h', w']
    grown[1:] |= component[y0:y1, x0:x1][:-1]
    grown[:-1] |= component[y0:y1, x0:x1][1:]
    grown[:, 1:] |= grown[:, :-1].copy()
    grown[:, :-1] |= grown[:, 1:].copy()
    keep = component[y0:y1, x0:x1] | (grown & background[y0:y1, x0:x1])
    return np.where(keep, coverage[y0:y1, x0:x1], 0.0), (int(x0), int(y0))


def template_overlaps(soft: np.ndarray, cx: float, cy: float) -> dict[str, float]:
    """Soft IoU (sum of minima / sum of maxima) of a coverage window with each ideal shape of the
    same area and centroid (`cx`, `cy` in window pixels), drawn as `render` draws them
    (`geometry.OUTLINES`, upright, at the size that gives that area).

    Templates are rasterised with sub-pixel samples (4x4 for small windows) so that a small
    shape's partly covered corners are compared like for like.
    """
    area = float(soft.sum())
    h, w = soft.shape
    sub = int(np.clip(128 // max(h, w), 1, 4))
    gx = (np.arange(w * sub) + 0.5) / sub - cx  # [w*sub]
    gy = ((np.arange(h * sub) + 0.5) / sub - cy)[:, None]  # [h*sub, 1]
    overlaps = {}
    for name in SHAPES:
        scale = np.sqrt(area / geometry.area(name))  # the size at which the shape has this area
        samples = geometry.inside(name, gx / scale, gy / scale)  # [h*sub, w*sub]
        template = samples.reshape(h, sub, w, sub).mean(axis=(1, 3))  # [h, w] coverage
        overlaps[name] = float(np.minimum(soft, template).sum() / np.maximum(soft, template).sum())
    return overlaps

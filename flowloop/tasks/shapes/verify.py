"""The verifiable reward: does a picture show what its prompt asks for?

`verify` reads the picture back into objects (`readback.py`) and checks the prompt's constraints
on them (`constraints.py`). `score` is the fraction of constraints met, a dense reward for RL;
`correct` is all of them, the GenEval-style accuracy ("a square" is met by two squares); `strict`
also needs exactly the objects asked for, no surplus ("a square" is one square and nothing else).
"""

from dataclasses import dataclass, field

import numpy as np

from .constraints import check
from .prompts import parse_prompt
from .readback import detect_objects
from .spec import Spec


@dataclass(frozen=True)
class Verdict:
    """`correct`: every constraint met (GenEval-style). `surplus_objects`: objects seen minus
    objects asked for (< 0: fewer). `details`: "objects" (what was seen) and "constraints"
    ({name: met}), JSON-serialisable."""

    correct: bool
    score: float
    surplus_objects: int = 0
    details: dict = field(default_factory=dict)

    @property
    def exact_count(self) -> bool:
        """As many objects in the picture as the prompt asks for."""
        return self.surplus_objects == 0

    @property
    def strict(self) -> bool:
        """Exactly what the prompt asks for: every constraint met and no object beyond them."""
        return self.correct and self.exact_count


def verify(image, spec: Spec | str) -> Verdict:
    """Check one picture against a Spec or a prompt string.

    `image`: numpy uint8 `[H, W, 3]`, numpy float `[H, W, 3]` in [0, 1], a PIL image, or a torch
    tensor `[3, H, W]` (float in [0, 1] or uint8). Torch is never imported here: a tensor is
    recognised by its type's module.
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    elif not isinstance(spec, Spec):
        raise ValueError(f"spec must be a Spec or a prompt str, got {type(spec).__name__}")
    objects = detect_objects(to_rgb255(image))
    results = check(objects, spec)
    met = sum(ok for _, ok in results)
    return Verdict(
        correct=met == len(results),
        score=met / len(results),
        surplus_objects=len(objects) - spec.object_count,
        details={
            "objects": [o.to_dict() for o in objects],
            "constraints": {name: bool(ok) for name, ok in results},
        },
    )


def verify_batch(images, specs) -> list[Verdict]:
    """`verify` per row. `images`: a sequence of pictures, a `[B, 3, H, W]` tensor or a
    `[B, H, W, 3]` array; `specs`: Specs or prompt strings, one per picture."""
    if len(images) != len(specs):
        raise ValueError(f"images and specs must have the same length, got {len(images)} and {len(specs)}")
    return [verify(image, spec) for image, spec in zip(images, specs)]


def to_rgb255(image) -> np.ndarray:
    """Any accepted picture -> float32 `[H, W, 3]` in 0..255."""
    # 1. Torch tensors, recognised without importing torch: [3, H, W] -> [H, W, 3].
    if hasattr(image, "detach") and type(image).__module__.startswith("torch"):
        tensor = image.detach().cpu()
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()  # bf16 has no numpy
        if array.ndim != 3 or array.shape[0] != 3:
            raise ValueError(f"a tensor image must be [3, H, W], got shape {tuple(array.shape)}")
        array = array.transpose(1, 2, 0)
    # 2. PIL images (anything with .convert and .size).
    elif hasattr(image, "convert") and hasattr(image, "size"):
        array = np.asarray(image.convert("RGB"))
    elif isinstance(image, np.ndarray):
        array = image
    else:
        raise ValueError(f"image must be a numpy array, PIL image or torch tensor, got {type(image).__name__}")
    if array.ndim != 3 or array.shape[2] != 3 or min(array.shape[:2]) < 1:
        raise ValueError(f"image must be [H, W, 3] (numpy/PIL) or [3, H, W] (torch), got shape {array.shape}")
    # 3. Scale: uint8 as is, floats from [0, 1].
    if array.dtype == np.uint8:
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.floating):
        # Slight overshoot (a model's output) is clipped; a wrong range is an error, not all-white.
        low, high = float(np.nanmin(array)), float(np.nanmax(array))
        if low < -0.25 or high > 1.25:
            raise ValueError(
                f"a float image must be in [0, 1], got values in [{low:.3g}, {high:.3g}]; "
                "pass uint8 for 0..255, or (x + 1) / 2 for [-1, 1]"
            )
        return np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0
    raise ValueError(f"image dtype must be uint8 or float in [0, 1], got {array.dtype}")

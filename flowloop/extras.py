"""Optional parts (Ray, peft, wandb, OCR) live in pip extras; importing one that is missing
fails with the extra to install, not a bare ModuleNotFoundError from deep inside a worker."""

from __future__ import annotations

import importlib

EXTRAS = {"ray": "ray", "peft": "peft", "wandb": "wandb", "pytesseract": "ocr", "tensorboard": "tensorboard", "pyarrow": "parquet"}
"""Module name -> the flowloop extra that installs it."""


def require(module: str, feature: str):
    """Import ``module`` or raise ImportError naming ``feature`` and the pip extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0]:
            raise
        extra = EXTRAS.get(module.split(".")[0], module)
        raise ImportError(
            f"{feature} needs the '{module}' package, which is not installed. "
            f"Install it with: pip install 'flowloop[{extra}]'"
        ) from None

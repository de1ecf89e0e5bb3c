"""Models behind one interface (`FlowModel`), loaded from local folders in diffusers layout."""

from __future__ import annotations

from pathlib import Path

import torch

from flowloop.models.base import FlowModel
from flowloop.models.loading import read_model_index

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny-shapes"
"""The shipped base model of the shapes world (fp16 safetensors, a few MB)."""


def load_flow_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> FlowModel:
    """Load a model folder (the embedded model when ``path`` is None) as a `FlowModel`."""
    path = Path(path) if path else EMBEDDED_MODEL
    pipeline = read_model_index(path).get("_class_name")
    if pipeline == "FlowloopTinyPipeline":
        from flowloop.models.tiny import TinyFlowModel

        return TinyFlowModel.from_pretrained(path, dtype=dtype, device=device)
    raise ValueError(f"{path}/model_index.json names pipeline {pipeline!r}; supported: ['FlowloopTinyPipeline']")


__all__ = ["EMBEDDED_MODEL", "FlowModel", "load_flow_model"]

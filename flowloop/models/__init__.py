"""Models behind one interface (`FlowModel`), loaded from local folders in diffusers layout."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

from flowloop.models.base import FlowModel
from flowloop.models.loading import read_model_index
from flowloop.models.trained import TrainedWeights, load_trained_weights

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny-shapes"
"""The shipped base model of the shapes world (fp16 safetensors, a few MB)."""


ADAPTERS = {
    "FlowloopTinyPipeline": "flowloop.models.tiny:TinyFlowModel",
    "StableDiffusion3Pipeline": "flowloop.models.sd3:SD3FlowModel",
    "FluxPipeline": "flowloop.models.flux:FluxFlowModel",
    "QwenImagePipeline": "flowloop.models.qwen_image:QwenImageFlowModel",
    "WanPipeline": "flowloop.models.wan:WanFlowModel",
}
"""``model_index.json`` ``_class_name`` -> the adapter class that loads such a folder."""


def load_flow_model(
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    **options,
) -> FlowModel:
    """Load a model folder (the embedded model when ``path`` is None) as a `FlowModel`.

    The folder's ``model_index.json`` names its pipeline class, which picks the adapter;
    ``options`` go to that adapter's ``from_pretrained`` (config ``model.options``).
    """
    path = Path(path) if path else EMBEDDED_MODEL
    pipeline = read_model_index(path).get("_class_name")
    if pipeline not in ADAPTERS:
        raise ValueError(f"{path}/model_index.json names pipeline {pipeline!r}; supported: {sorted(ADAPTERS)}")
    module_name, class_name = ADAPTERS[pipeline].split(":")
    adapter = getattr(importlib.import_module(module_name), class_name)
    accepted = [n for n in inspect.signature(adapter.from_pretrained).parameters if n not in ("path", "dtype", "device")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"model.options {unknown} are not options of {class_name}; it takes {accepted}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return adapter.from_pretrained(path, dtype=dtype, device=device, **options)


def family(path: str | Path | None) -> str:
    """The adapter family of a model folder (``tiny``, ``sd3``, ``flux``, ``qwen_image``, ``wan``)."""
    pipeline = read_model_index(Path(path) if path else EMBEDDED_MODEL).get("_class_name")
    if pipeline not in ADAPTERS:
        raise ValueError(f"{path}/model_index.json names pipeline {pipeline!r}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[pipeline].split(":")[0].rsplit(".", 1)[-1]


__all__ = ["ADAPTERS", "EMBEDDED_MODEL", "FlowModel", "TrainedWeights", "family", "load_flow_model", "load_trained_weights"]

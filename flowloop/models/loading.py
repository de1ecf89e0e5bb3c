"""Loading a model folder from local disk, in diffusers layout, for every model family.

A model folder holds ``model_index.json`` naming the pipeline class and one sub-folder per
component (``transformer/``, ``text_encoder/``, ``tokenizer/``, ``vae/`` ...). flowloop never
resolves hub ids: nothing is downloaded at run time, so a path that does not exist is an error
that says so, and a missing file names itself before a library deep below can fail obscurely.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from flowloop.models.base import SchedulerShift

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def read_model_index(root: str | Path) -> dict:
    """Parse ``model_index.json`` of a local model folder, with errors that name the path."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"model.path={str(root)!r} is not a folder. flowloop loads models from local folders "
            "in diffusers layout only (no hub ids); point model.path at such a folder."
        )
    index = root / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{index} is missing: a model folder needs a model_index.json naming its components.")
    try:
        return json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{index} is not valid JSON ({err}).") from err


def require_component_files(root: str | Path, subfolder: str, needs_weights: bool = True) -> Path:
    """Check ``root/subfolder`` has a config.json (and weights); return the folder.

    Raises FileNotFoundError naming the first missing file, so a half-copied checkpoint fails
    with the file to restore instead of a stack trace from inside diffusers.
    """
    folder = Path(root) / subfolder
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing: the model folder has no '{subfolder}' component.")
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} is missing: every component folder needs its config.json.")
    if needs_weights and not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
        raise FileNotFoundError(
            f"{folder} has no weights file (*.safetensors or *.bin): the component's weights are missing."
        )
    return folder


def load_component(root: str | Path, subfolder: str, cls, dtype: torch.dtype = torch.float32):
    """Load a diffusers/transformers component class from ``root/subfolder``, offline."""
    require_component_files(root, subfolder)
    # Without accelerate, diffusers warns and falls back to a full-memory load; ask for it directly.
    quiet = {} if importlib.util.find_spec("accelerate") else {"low_cpu_mem_usage": False}
    return cls.from_pretrained(str(root), subfolder=subfolder, torch_dtype=dtype, local_files_only=True, **quiet)


def load_tokenizer(root: str | Path, subfolder: str = "tokenizer"):
    """Load a fast tokenizer from ``root/subfolder`` (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer

    folder = Path(root) / subfolder
    needed = folder / "tokenizer.json"
    if not needed.is_file():
        raise FileNotFoundError(f"{needed} is missing: the model folder's tokenizer is incomplete.")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{folder} gave a slow tokenizer; flowloop needs a fast (tokenizers) one.")
    return tokenizer


def read_scheduler_shift(root: str | Path) -> SchedulerShift:
    """The `SchedulerShift` of ``root/scheduler/scheduler_config.json``; no shift without one."""
    path = Path(root) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return SchedulerShift()
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}).") from err
    dynamic = bool(config.get("use_dynamic_shifting", False))
    if dynamic and config.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"{path}: time_shift_type={config['time_shift_type']!r} with dynamic shifting is not supported "
                         "(only 'exponential', as FLUX and Qwen-Image); set rollout.pipeline.shift to a number")
    defaults = SchedulerShift()
    return SchedulerShift(
        shift=float(config.get("shift", config.get("flow_shift", defaults.shift))),
        dynamic=dynamic,
        base_seq_len=int(config.get("base_image_seq_len", defaults.base_seq_len)),
        max_seq_len=int(config.get("max_image_seq_len", defaults.max_seq_len)),
        base_shift=float(config.get("base_shift", defaults.base_shift)),
        max_shift=float(config.get("max_shift", defaults.max_shift)),
        shift_terminal=config.get("shift_terminal") or None,
    )

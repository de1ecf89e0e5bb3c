"""Writing checkpoint files durably and checking them: fsync, sha256, what a state file may hold.

`flowloop.trainer.checkpoint` builds on these; they know nothing of steps or run folders.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flowloop.models.trained import file_sha256 as sha256

__all__ = ["check_plain", "fsync", "fsync_dir", "safetensors_ready", "sha256", "state_dict", "torch_save", "write_synced"]


_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """Only what ``torch.load(weights_only=True)`` reads back: a ValueError names the first other value."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise ValueError(
            f"{where} is a {type(value).__name__}; checkpoints hold only None, bool, int, float, str, "
            "tensors, and lists/tuples/dicts of them (convert it, e.g. with .tolist() or a state_dict())"
        )


def state_dict(obj: Any) -> dict:
    return obj if isinstance(obj, Mapping) else obj.state_dict()


def safetensors_ready(model_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, detached; tensors sharing storage (tied weights) are cloned apart."""
    out, seen = {}, set()
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model_state[{key!r}] must be a tensor, got {type(value).__name__}")
        tensor = value.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

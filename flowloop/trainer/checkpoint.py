"""Checkpoints and run folders: atomic writes, validation by hash, resume, never overwrite a run.

A run folder (`new_run_dir`) holds ``checkpoints/step_{N:06d}/``, each with

    model.safetensors   the trained weights (full weights or adapters: whatever dict is passed)
    optimizer.pt        optimizer.state_dict()                       (when given)
    dcp/                instead of those two, from a trainer sharded over several ranks: each
                        rank's shards of the weights and optimizer state, written by the ranks
                        with torch.distributed.checkpoint (`save_checkpoint`'s ``shards``)
    schedulers.pt       [scheduler.state_dict(), ...]                (when given)
    state.pt            step, RNG states, data position, extra       (plain types and tensors)
    flowloop.json       what the weights are: base model, family, dtype, LoRA settings
                        (`flowloop.models.TrainedWeights`; when given), so the folder loads alone
    manifest.json       format, step, and every file's size and sha256 (``dcp/`` files by their
                        path inside the folder), written last

A checkpoint is written into a temporary folder beside its final place, every file fsynced, then
renamed into place, so a crash leaves either a complete checkpoint or a ``.tmp`` folder that is
never read. `latest_valid_checkpoint` re-hashes every file against the manifest and skips (with a
warning) any folder that does not match. ``.pt`` files are loaded with ``weights_only=True``, so
``data_state`` and ``extra`` must hold plain Python types and tensors.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowloop.models.trained import CHECKPOINT_FORMAT as FORMAT
from flowloop.models.trained import DESCRIPTION, MANIFEST, SHARDS, TrainedWeights, checkpoint_problem
from flowloop.trainer.checkpoint_files import (
    check_plain, fsync, fsync_dir, safetensors_ready, sha256, state_dict, torch_save, write_synced,
)

__all__ = [
    "LoadedCheckpoint",
    "capture_rng_state",
    "checkpoint_problem",
    "describe_weights",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "new_run_dir",
    "resolve_resume",
    "restore_rng_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class LoadedCheckpoint:
    """What `load_checkpoint` read; optimizer and scheduler states are also loaded into the objects given."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    """Empty for a sharded checkpoint: its weights are in ``shards``."""
    optimizer_state: dict | None = None
    shards: Path | None = None
    """A sharded checkpoint's ``dcp/`` folder (weights and optimizer state), else None."""
    scheduler_states: list[dict] | None = None
    rng_state: dict | None = None
    data_state: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states of Python ``random``, numpy, torch CPU and (when present) every CUDA device."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the global RNGs back to a `capture_rng_state` result."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    keys = np.asarray(np_state["keys"], dtype=np.int64).astype(np.uint32)
    np.random.set_state(
        (np_state["bit_generator"], keys, np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, found %d: CUDA RNGs not restored",
                len(state["cuda"]), found,
            )


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer: Any = None,
    schedulers: Sequence[Any] | None = None,
    rng_state: Mapping[str, Any] | None = None,
    data_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    description: TrainedWeights | None = None,
    shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_{step:06d}/`` atomically and return its path.

    ``optimizer``/``schedulers``: objects with ``state_dict()`` (or state dicts). ``rng_state``:
    `capture_rng_state()`. ``data_state``: where the data loader is (plain types). ``extra``:
    anything else to restore (plain types and tensors: advantage tracker, non-finite guard...).
    ``description``: what ``model_state`` is (`describe_weights`), for loading and export.
    ``keep_last``: afterwards delete all but the newest ``keep_last`` step folders (None: keep all).
    ``shards``: in place of ``model_state`` (None) and ``optimizer``, called with the empty
    ``dcp/`` folder of the checkpoint being written, where the trainer ranks write their shards
    (`flowloop.trainer.placement.WorkerGroup.save_shards`); an error it raises leaves no checkpoint.
    An existing folder for the same step is replaced.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    if (model_state is None) == (shards is None):
        raise ValueError("pass either model_state (one file) or shards (a sharded trainer writes them), not both")
    parent = Path(run_dir) / CHECKPOINTS
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        # 1. Every file into the temporary folder, each fsynced (torch.distributed.checkpoint
        # fsyncs the files it writes).
        if shards is not None:
            (tmp / SHARDS).mkdir()
            shards(tmp / SHARDS)
            fsync_dir(tmp / SHARDS)
        else:
            save_file(safetensors_ready(model_state), tmp / "model.safetensors", metadata={"step": str(step)})
            fsync(tmp / "model.safetensors")
        if optimizer is not None:
            torch_save(state_dict(optimizer), tmp / "optimizer.pt")
        if schedulers is not None:
            torch_save([state_dict(s) for s in schedulers], tmp / "schedulers.pt")
        check_plain(dict(data_state or {}), "data_state")
        check_plain(dict(extra or {}), "extra")
        state = {"step": step, "rng_state": rng_state, "data_state": dict(data_state or {}), "extra": dict(extra or {})}
        torch_save(state, tmp / "state.pt")
        if description is not None:
            write_synced(tmp / DESCRIPTION, json.dumps(description.as_dict(), indent=1))

        # 2. The manifest last: a folder without a matching one is never taken as valid.
        files = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_synced(tmp / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
        fsync_dir(tmp)

        # 3. Rename into place (an old folder for this step is moved aside first, then removed).
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{final.name}.", suffix=".old"))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        _prune(parent, keep_last, keep=final)
    return final


def describe_weights(model_config, actor_config) -> TrainedWeights:
    """The `TrainedWeights` of a run from its ``model`` and ``actor`` config sections."""
    from flowloop.models import family

    path = str(Path(model_config.path).resolve()) if model_config.path else None
    lora = {}
    if actor_config.finetune == "lora":
        lora = {"rank": actor_config.lora_rank, "alpha": actor_config.lora_alpha,
                "target_modules": list(actor_config.lora_target_modules)}
    return TrainedWeights(model_path=path, family=family(path), dtype=str(model_config.dtype).removeprefix("torch."),
                          finetune=actor_config.finetune, lora=lora)


# ---------------------------------------------------------------------------------------------
# Find and load
# ---------------------------------------------------------------------------------------------


def latest_valid_checkpoint(run_dir: str | os.PathLike, verify_hashes: bool = True) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (None if it has none); newer broken ones are
    skipped with a warning naming them. ``verify_hashes=False`` checks sizes only (faster for
    large weights)."""
    for step, path in sorted(_step_dirs(Path(run_dir) / CHECKPOINTS), reverse=True):
        problem = checkpoint_problem(path, verify_hashes)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_checkpoint(
    path: str | os.PathLike,
    optimizer: Any = None,
    schedulers: Sequence[Any] | None = None,
    map_location: str | torch.device = "cpu",
    verify_hashes: bool = True,
) -> LoadedCheckpoint:
    """Read the checkpoint folder ``path``; a broken one is a ValueError saying what is wrong.

    Loads the optimizer and scheduler states into ``optimizer`` / ``schedulers`` when given (the
    checkpoint must have them). The model weights (``model_state``) and RNG states
    (`restore_rng_state`) are returned for the caller to apply. A sharded checkpoint's weights
    and optimizer state stay in its ``dcp/`` folder (``shards``), which the trainer ranks read.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    problem = checkpoint_problem(path, verify_hashes)
    if problem is not None:
        raise ValueError(f"{path} is not a valid checkpoint: {problem}")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    sharded = (path / SHARDS).is_dir()
    ckpt = LoadedCheckpoint(
        path=path,
        step=int(state["step"]),
        model_state={} if sharded else load_file(path / "model.safetensors", device=str(map_location)),
        shards=path / SHARDS if sharded else None,
        rng_state=state["rng_state"],
        data_state=state["data_state"],
        extra=state["extra"],
    )
    if (path / "optimizer.pt").is_file():
        ckpt.optimizer_state = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True)
    if (path / "schedulers.pt").is_file():
        ckpt.scheduler_states = torch.load(path / "schedulers.pt", map_location="cpu", weights_only=True)
    if optimizer is not None:
        if ckpt.optimizer_state is None:
            where = " (it is sharded: the trainer ranks load it from dcp/)" if sharded else ""
            raise ValueError(f"{path} has no optimizer state to load{where}")
        optimizer.load_state_dict(ckpt.optimizer_state)
    if schedulers is not None:
        states = ckpt.scheduler_states or []
        if len(states) != len(schedulers):
            raise ValueError(f"{path} holds {len(states)} scheduler states, {len(schedulers)} schedulers were given")
        for scheduler, scheduler_state in zip(schedulers, states):
            scheduler.load_state_dict(scheduler_state)
    return ckpt


# ---------------------------------------------------------------------------------------------
# Run folders and resume
# ---------------------------------------------------------------------------------------------


def new_run_dir(root: str | os.PathLike, name: str) -> Path:
    """Create and return a fresh ``root/name`` folder; if that exists, ``root/name-1``, ``-2``...

    Never returns an existing folder (the creation itself is the check, so two runs started at
    once get two folders).
    """
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"run name must be a plain folder name (no path separators), got {name!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for suffix in range(100_000):
        path = root / (name if suffix == 0 else f"{name}-{suffix}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name for {name!r} under {root}")


def resolve_resume(run_dir: str | os.PathLike, resume: str | os.PathLike = "auto") -> Path | None:
    """The checkpoint a run should continue from, or None to start from scratch.

    - ``"auto"``: the newest valid checkpoint of ``run_dir``; None when it has no checkpoint
      folder at all; a ValueError when it has some but none is valid (starting over would
      overwrite that run's logs).
    - ``"never"``: None; a ValueError if ``run_dir`` already holds checkpoints (a new run needs a
      new folder: `new_run_dir`).
    - a path: that checkpoint folder (must be valid), or a run folder's newest valid checkpoint.
    """
    run_dir = Path(run_dir)
    if resume == "never":
        if _step_dirs(run_dir / CHECKPOINTS):
            raise ValueError(
                f"resume=never but {run_dir} already holds checkpoints; start the new run in a new folder (new_run_dir)"
            )
        return None
    if resume == "auto":
        found = _step_dirs(run_dir / CHECKPOINTS)
        if not found:
            return None
        latest = latest_valid_checkpoint(run_dir)
        if latest is None:
            names = ", ".join(p.name for _, p in sorted(found))
            raise ValueError(
                f"resume=auto: no valid checkpoint in {run_dir / CHECKPOINTS} (broken: {names}); "
                "pass resume=<path> or start a new run folder"
            )
        return latest
    path = Path(resume)
    if not path.exists():
        raise ValueError(
            f"resume must be 'auto', 'never' or the path of a checkpoint or run folder; {str(resume)!r} does not exist"
        )
    if (path / MANIFEST).exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"resume={str(resume)!r} is not a valid checkpoint: {problem}")
        return path
    latest = latest_valid_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"resume={str(resume)!r} is neither a checkpoint folder nor a run folder with a valid checkpoint"
        )
    return latest


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _step_dirs(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return found


def _prune(parent: Path, keep_last: int, keep: Path) -> None:
    for _, path in sorted(_step_dirs(parent), reverse=True)[keep_last:]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)

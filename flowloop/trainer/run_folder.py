"""A run folder's guard rails: one live process per folder, what a resume may change, leftovers.

- `RunLock`: ``run_dir/.lock``, held (``flock``) by the process training into the folder; a second
  process is refused with the holder's pid. The kernel drops the lock when its process dies, so a
  lock file left by a killed run is taken over (with a warning naming the dead pid).
- `check_resume_config`: the requested config against the run's ``config.yaml``. A change the
  checkpoint cannot take (another base model, fine-tune mode, LoRA shape, objective) or that its
  restored state would silently override (the schedule's shape, seeds) is refused, naming the keys;
  every other change applies from the resumed step on and is listed in the log (``actor.lr`` and
  ``actor.weight_decay`` by rewriting the restored optimizer and schedule: `apply_to_train_state`).
- `clean_stale_temporaries`: ``.tmp`` / ``.old`` folders of checkpoint writes that were killed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
from pathlib import Path

from omegaconf import OmegaConf

from flowloop.config import to_yaml

__all__ = ["LOCK_FILE", "RunLock", "apply_to_train_state", "changed_settings", "check_resume_config", "clean_stale_temporaries"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"

FIXED = {
    "model.path": "the checkpoint holds weights of the run's base model",
    "model.dtype": "the checkpoint's weights and optimizer state were trained in the run's dtype",
    "actor.objective": "the optimizer state and the rollout records belong to the run's objective",
    "actor.finetune": "the checkpoint holds the run's kind of weights (full or LoRA adapters)",
    "actor.lora_rank": "the checkpoint's LoRA adapters have the run's shape",
    "actor.lora_alpha": "the checkpoint's LoRA adapters were trained at the run's scale",
    "actor.lora_target_modules": "the checkpoint's LoRA adapters sit on the run's layers",
}
"""Keys a checkpoint cannot be resumed under another value of, with why."""

RESTORED = {
    "actor.warmup_steps": "the schedule comes back from the checkpoint",
    "actor.lr_schedule": "the schedule comes back from the checkpoint",
    "actor.lr_final_ratio": "the schedule comes back from the checkpoint",
    "actor.ema_decay": "the EMA weights come back from the checkpoint",
    "trainer.seed": "the prompt order and the trainer's generator come back from the checkpoint",
    "advantage.estimator": "the advantage tracker's state comes back from the checkpoint",
}
"""Keys whose value lives in the checkpoint's state: a change could not take effect, so it is refused."""

RUN_IDENTITY = ("trainer.resume", "trainer.run_root", "trainer.run_name")
"""Keys that say which run to resume, not how it trains."""


class RunLock:
    """``with RunLock(run_dir):`` or ``acquire()`` / ``release()``; a held lock is a ValueError."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"run folder {self.path.parent} is in use by {holder} (lock file {self.path}); wait for that "
                             "run to end, or train into another folder (trainer.run_name)") from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if previous:
            logger.warning("run folder %s: taking over the lock of %s, which is no longer running", self.path.parent, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty lock file: nobody holds the folder (kept: unlinking it races a new holder)
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def changed_settings(saved_yaml: str, cfg) -> dict[str, tuple]:
    """``{key: (run's value, requested value)}`` for every setting that differs (keys only one side
    has, from an older or newer schema, are left out)."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    requested = _flat(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    return {key: (saved[key], requested[key]) for key in requested
            if key in saved and saved[key] != requested[key] and key not in RUN_IDENTITY}


def check_resume_config(run_dir: Path, cfg, log=logger.info) -> dict[str, tuple]:
    """Refuse (ValueError naming every such key) a change a resume cannot honour; return the
    changes that apply, after logging them. A run folder without ``config.yaml`` is not checked."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        logger.warning("%s is missing: the requested settings are not compared with the run's", path)
        return {}
    changed = changed_settings(path.read_text(), cfg)
    refused = [key for key in changed if key in FIXED or key in RESTORED]
    if refused:
        lines = "; ".join(f"{key}={changed[key][1]!r} (run: {changed[key][0]!r}): {FIXED.get(key) or RESTORED[key]}"
                          for key in refused)
        raise ValueError(f"trainer.resume: cannot resume {run_dir} with changed {', '.join(refused)}: {lines}. Resume "
                         "with the run's values (its config.yaml), or start a new run (trainer.resume=never)")
    if changed:
        log("resume applies changed settings: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    return changed


def clean_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the ``.step_*.tmp`` / ``.old`` folders killed checkpoint writes left (call while
    holding the run's lock: no live writer can own them then); returns what was removed."""
    parent = run_dir / "checkpoints"
    if not parent.is_dir():
        return []
    stale = [p for p in parent.iterdir() if p.name.startswith(".step_") and p.name.endswith((".tmp", ".old"))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("removed %s, left by an interrupted checkpoint write", path)
    return stale


def apply_to_train_state(state: dict, changed: dict[str, tuple]) -> None:
    """Put a changed ``actor.lr`` (scaling the current rate, the schedule's base rates and the
    rates it decays from) or ``actor.weight_decay`` into a checkpoint's optimizer and schedule
    state before it is loaded, so the resumed run trains with the requested values."""
    groups = state["optimizer"]["param_groups"]
    if "actor.lr" in changed:
        old, new = changed["actor.lr"]
        for group in groups:
            group["lr"] = group["lr"] / old * new
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] / old * new
        schedule = state["scheduler"]
        for key in ("base_lrs", "_last_lr"):
            if key in schedule:
                schedule[key] = [value / old * new for value in schedule[key]]
    if "actor.weight_decay" in changed:
        for group in groups:
            group["weight_decay"] = changed["actor.weight_decay"][1]

"""Where a run's numbers go: ``metrics.jsonl`` always, TensorBoard and wandb when asked, and a
live progress line on the terminal. Validation grids go to TensorBoard (``add_image``) and wandb
(``wandb.Image``) as images (`MetricsLogger.log_image`); the PNG files stay in the run folder.

``metrics.jsonl`` has one JSON object per step, ``{"step": N, "time": unix_seconds, ...}``,
flushed as it is written; nested dicts are flattened with ``/`` (``{"eval": {"accuracy": x}}``
becomes ``"eval/accuracy"``), tensors and numpy scalars become numbers, NaN and inf become
``null``. A resumed run (``resume_step=N``) first drops every line with a step above N (and any
torn last line), so the file never holds two lines for one step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image
from tqdm import tqdm

from flowloop.extras import require

__all__ = ["DEFAULT_WANDB_PROJECT", "METRICS_FILE", "MetricsLogger", "ProgressLine", "flatten_metrics", "read_metrics"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "config.yaml"
"""The resolved run config the recipe writes into the run folder before logging starts."""
DEFAULT_WANDB_PROJECT = "flowloop"


class MetricsLogger:
    """Writes each step's metrics to ``run_dir/metrics.jsonl`` and the backends asked for.

    ``tensorboard=True``: events in ``run_dir/tensorboard`` (needs the ``tensorboard`` extra).
    ``wandb=True``: a wandb run (needs the ``wandb`` extra) whose id is kept in
    ``run_dir/wandb_id.txt`` so a resumed run continues it. Its config is ``config``, else the
    run folder's ``config.yaml`` (the resolved `TrainConfig`); its project is
    ``wandb_init["project"]``, else that config's ``trainer.wandb_project``, else "flowloop";
    the rest of ``wandb_init`` goes to ``wandb.init`` too.
    ``resume_step``: the step of the checkpoint this run resumes from (None for a new run: then
    ``metrics.jsonl`` must not exist yet).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        tensorboard: bool = False,
        wandb: bool = False,
        resume_step: int | None = None,
        config: Mapping[str, Any] | None = None,
        wandb_init: Mapping[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE

        # 1. metrics.jsonl: truncate to the resumed step, then append.
        if resume_step is None and self.path.exists() and self.path.stat().st_size > 0:
            raise ValueError(
                f"{self.path} already exists: pass resume_step to continue that run, or use a new run folder"
            )
        if resume_step is not None and self.path.exists():
            _truncate_after(self.path, resume_step)

        # 2. Optional backends, each only when asked for (a missing package fails before any write).
        self._tensorboard = None
        if tensorboard:
            require("tensorboard", "TensorBoard logging (tensorboard=true)")
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # drop events past the checkpoint
            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb:
            wandb_module = require("wandb", "wandb logging (wandb=true)")
            id_file = self.run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.exists() else wandb_module.util.generate_id()
            id_file.write_text(run_id)
            config = dict(config) if config is not None else _run_config(self.run_dir)
            project = config.get("trainer", {}).get("wandb_project") or DEFAULT_WANDB_PROJECT
            init = {"project": project, "name": self.run_dir.name, "dir": str(self.run_dir), "config": config}
            init.update(wandb_init or {})
            self._wandb = wandb_module.init(id=run_id, resume="allow", **init)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float | int | None]:
        """Write one step's ``metrics`` everywhere; returns the flattened numbers written."""
        flat = flatten_metrics(metrics)
        record = {"step": int(step), "time": round(time.time(), 3), **flat}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in flat.items():
                if value is not None:
                    self._tensorboard.add_scalar(key, value, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log(flat, step=int(step))
        return flat

    def log_image(self, step: int, tag: str, image: str | os.PathLike | np.ndarray) -> None:
        """Send one image (a PNG/JPEG path, or uint8 ``[H, W, 3]``) to TensorBoard and wandb under
        ``tag`` at ``step``; ``metrics.jsonl`` holds numbers only, so it is not written there."""
        if self._tensorboard is None and self._wandb is None:
            return
        if isinstance(image, (str, os.PathLike)):
            with Image.open(image) as opened:
                image = np.asarray(opened.convert("RGB"))
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"image {tag!r} must be uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}")
        if self._tensorboard is not None:
            self._tensorboard.add_image(tag, image, global_step=int(step), dataformats="HWC")
            self._tensorboard.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image(image)}, step=int(step))

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if not self._file.closed:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressLine:
    """One live line: ``step 12/300 | reward 0.512 | acc 0.437 | 4.10 s/step | ETA 19:40``.

    ``update(step, reward=..., accuracy=..., step_time=...)`` after each step (``step`` = steps
    done); the held-out accuracy is shown until the next evaluation replaces it. The ETA is this
    session's mean step time times the steps left, so a resumed run does not count skipped steps.
    """

    def __init__(self, total_steps: int, start_step: int = 0, file=None, disable: bool = False):
        self.total = total_steps
        self.accuracy: float | None = None
        self._time_sum, self._steps_timed = 0.0, 0
        self._bar = tqdm(
            total=total_steps, initial=start_step, file=file or sys.stderr, disable=disable,
            dynamic_ncols=True, bar_format="{desc}", leave=True,
        )
        self._bar.set_description_str(self.text(start_step, None, None))

    def update(
        self, step: int, reward: float | None = None, accuracy: float | None = None, step_time: float | None = None
    ) -> str:
        """Show the line for ``step`` and return its text."""
        if accuracy is not None:
            self.accuracy = float(accuracy)
        if step_time is not None:
            self._time_sum, self._steps_timed = self._time_sum + step_time, self._steps_timed + 1
        line = self.text(step, reward, step_time)
        self._bar.set_description_str(line, refresh=False)
        self._bar.update(step - self._bar.n)
        return line

    def text(self, step: int, reward: float | None, step_time: float | None) -> str:
        eta = self._time_sum / self._steps_timed * max(self.total - step, 0) if self._steps_timed else None
        return " | ".join([
            f"step {step}/{self.total}",
            f"reward {reward:.3f}" if reward is not None else "reward -",
            f"acc {self.accuracy:.3f}" if self.accuracy is not None else "acc -",
            f"{step_time:.2f} s/step" if step_time is not None else "- s/step",
            f"ETA {_clock(eta)}" if eta is not None else "ETA -",
        ])

    def close(self) -> None:
        self._bar.close()


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | None]:
    """``{"a": {"b": t}}`` -> ``{"a/b": float(t)}``; NaN and inf -> None; non-numbers are a ValueError."""
    flat: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, prefix=f"{name}/"))
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} must be a number, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)):
            raise ValueError(f"metric {name!r} must be a number, got {type(value).__name__}")
        flat[name] = None if isinstance(value, float) and not math.isfinite(value) else value
    return flat


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of ``run_dir/metrics.jsonl`` (for tests, plots and resume checks)."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


CATEGORY_PREFIX = "reward/category/"
"""Where `flowloop.trainer.step_metrics.category_reward_means` logs each prompt category's training reward."""


def category_names(keys) -> list[str]:
    """The prompt categories named by ``reward/category/<name>/...`` metric keys, sorted."""
    return sorted({key.split("/")[2] for key in keys if key.startswith(CATEGORY_PREFIX)})


def accuracy_key(prefix: str, keys) -> str:
    """``<prefix>/correct`` when ``keys`` hold it (the reward reports an accuracy, as the shapes
    rewards do), else ``<prefix>/mean``: the one rule for "how often right" that `flowloop plot`
    and the category focus share."""
    return f"{prefix}/correct" if f"{prefix}/correct" in keys else f"{prefix}/mean"


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _truncate_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without lines past ``step`` and without unreadable lines."""
    kept, dropped, torn = [], 0, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            torn += 1
            continue
        if record_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped or torn:
        logger.warning(
            "%s: resuming at step %d, dropped %d later lines and %d unreadable lines", path, step, dropped, torn
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _run_config(run_dir: Path) -> dict:
    """The run folder's resolved config as a dict; empty when there is none."""
    path = run_dir / RUN_CONFIG_FILE
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"

"""The prompt-file task: train on a file's prompts with any reward, validate by that reward.

`data.prompt_file` names the training prompts; validation samples `data.val_prompt_file`, or the
first ``data.val_train_prompts`` training prompts, and reports the run's reward on them
(``val/reward``, plus the mean of each numeric extra the reward returns).

Three formats, chosen by the suffix: ``.parquet`` (verl's dataset files, one row per prompt with
the same fields as a JSON line; needs ``pyarrow``, the ``parquet`` extra), ``.txt`` (one prompt per line; blank lines and lines starting
with ``#`` are skipped) and ``.jsonl`` (one object per line with a ``prompt`` string; other
fields are kept, so a reward can read, say, the text an OCR prompt quotes, and a ``category``
field splits the training reward by category in ``metrics.jsonl``). A verl dataset's rows work
as they are: ``prompt`` as chat messages (``[{"role": "user", "content": ...}]``, kept as such
for the chat template), ``data_source`` (route rewards with ``by_data_source``),
``reward_model``, ``extra_info`` and ``raw_negative_prompt`` are carried to the reward. Errors name the file
and the line, so a broken line in a 50k-prompt file is found at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flowloop.tasks.base import Grid, draw_uniform, register_task, reward_extra_means, step_rng

SUFFIXES = (".txt", ".jsonl", ".parquet")
GRID_ROWS = 32
"""Validation samples shown in the grid, one per row."""


def load_prompt_file(path: str | Path, key: str = "data.prompt_file") -> list[dict]:
    """Rows ``{"raw_prompt": str, **fields}`` from ``path``; ``key`` names the setting in errors."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{key}={path}: the suffix must be one of {list(SUFFIXES)} (one prompt per line, JSON lines, or verl's parquet)")
    if not path.is_file():
        raise FileNotFoundError(f"{key}={path}: no such file; give a local .txt (one prompt per line), .jsonl or .parquet file")
    if path.suffix == ".parquet":
        from flowloop.extras import require

        records = require("pyarrow.parquet", "a .parquet prompt file").read_table(path).to_pylist()
        rows = [_row(record, path, number) for number, record in enumerate(records, start=1)]
        if not rows:
            raise ValueError(f"{key}={path}: the file holds no prompts")
        return rows
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or (path.suffix == ".txt" and line.lstrip().startswith("#")):
            continue
        if path.suffix == ".txt":
            rows.append({"raw_prompt": line.strip()})
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        rows.append(_row(record, path, number))
    if not rows:
        raise ValueError(f"{key}={path}: the file holds no prompts")
    return rows


def _row(record, path: Path, number: int) -> dict:
    """A JSON line or parquet row as ``{"raw_prompt": ..., **other fields}``."""
    fields = {k: v for k, v in record.items() if k != "prompt"} if isinstance(record, dict) else {}
    return {"raw_prompt": _prompt(record, path, number), **fields}


def _prompt(record, path: Path, number: int) -> str | list[dict]:
    """A JSON line's ``prompt``: a non-empty string, or verl's chat messages."""
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if isinstance(prompt, str) and prompt.strip():
        return prompt.strip()
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt):
        return prompt
    raise ValueError(f"{path}:{number}: each line must be an object with a non-empty \"prompt\": a string, or chat "
                     "messages [{\"role\": \"user\", \"content\": \"...\"}] as in verl's datasets")


def prompt_caption(raw_prompt: str | list[dict]) -> str:
    """The text to show for a prompt: a string as is, chat messages by their last user message."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
    return users[-1] if users else str(raw_prompt[-1].get("content", ""))


class PromptFileTask:
    """Rows of a prompt file, drawn uniformly; validation is the mean reward of fixed rows."""

    val_metric = "val/reward"

    def __init__(self, train_rows: list[dict], val_rows: list[dict]):
        self.rows = train_rows
        self._val_rows = val_rows

    @classmethod
    def from_config(cls, cfg) -> PromptFileTask:
        data = cfg.data
        if data.prompt_file is None:
            raise ValueError("data.task=prompt_file needs data.prompt_file (a .txt or .jsonl file of prompts)")
        if data.prompt_sampling != "uniform":
            raise ValueError(f"data.prompt_sampling={data.prompt_sampling!r} needs the shapes world's categories; "
                             "use data.prompt_sampling=uniform with data.prompt_file")
        if data.val_train_prompts < 1:
            raise ValueError(f"data.val_train_prompts must be >= 1, got {data.val_train_prompts}")
        train = load_prompt_file(data.prompt_file)
        val = (load_prompt_file(data.val_prompt_file, "data.val_prompt_file") if data.val_prompt_file
               else train[: data.val_train_prompts])
        return cls(train, val)

    def train_rows(self, seed: int, step: int, count: int) -> list[dict]:
        return draw_uniform(self.rows, step_rng(seed, step), count)

    def val_rows(self) -> list[dict]:
        return list(self._val_rows)

    def evaluate(self, images: np.ndarray, rows: list[dict]) -> tuple[dict[str, float], Grid]:
        """``val/reward``: the mean of the rows' ``reward`` (failed ones left out), and
        ``val/reward/<key>`` for the reward's numeric extras."""
        if any("reward" not in row for row in rows):
            raise ValueError("the prompt-file task validates by the run's reward: every row needs a 'reward' "
                             "(set rollout.reward.name, or --reward for flowloop eval)")
        scores = np.array([row["reward"] for row in rows], dtype=np.float32)  # [V]
        metrics = {"val/reward": float(np.nanmean(scores)), **{f"val/{k}": v for k, v in reward_extra_means(rows).items()}}
        shown = min(len(rows), GRID_ROWS)
        return metrics, Grid(images[:shown], [prompt_caption(row["raw_prompt"]) for row in rows[:shown]], per_row=1)


register_task("prompt_file")(PromptFileTask.from_config)

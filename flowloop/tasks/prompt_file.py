"""Prompt files for models beyond the shapes world: what `data.prompt_file` points at.

Two formats, chosen by the suffix: ``.txt`` (one prompt per line; blank lines and lines starting
with ``#`` are skipped) and ``.jsonl`` (one object per line with a ``prompt`` string; other
fields are kept, so a reward can read, say, the text an OCR prompt quotes, and a ``category``
field splits the training reward by category in ``metrics.jsonl``). Errors name the file
and the line, so a broken line in a 50k-prompt file is found at once.
"""

from __future__ import annotations

import json
from pathlib import Path

SUFFIXES = (".txt", ".jsonl")


def load_prompt_file(path: str | Path, key: str = "data.prompt_file") -> list[dict]:
    """Rows ``{"raw_prompt": str, **fields}`` from ``path``; ``key`` names the setting in errors."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{key}={path}: the suffix must be one of {list(SUFFIXES)} (one prompt per line, or JSON lines)")
    if not path.is_file():
        raise FileNotFoundError(f"{key}={path}: no such file; give a local .txt (one prompt per line) or .jsonl file")
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
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f"{path}:{number}: each line must be an object with a non-empty \"prompt\" string")
        fields = {k: v for k, v in record.items() if k != "prompt"}
        rows.append({"raw_prompt": record["prompt"].strip(), **fields})
    if not rows:
        raise ValueError(f"{key}={path}: the file holds no prompts")
    return rows

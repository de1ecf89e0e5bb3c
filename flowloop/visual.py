"""What people look at: the per-category accuracy table and labelled image grids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def print_eval_table(result, title: str = "") -> None:
    """Print GenEval-style and strict accuracy and the score per category (with n), then both
    headlines, the mean over categories and over samples, with their 95% bootstrap intervals."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None, caption="geneval: every constraint met (at least: 'a square' is met by two "
                  "squares); strict: exactly the objects asked for; [95% bootstrap interval]")
    for column in ("category", "geneval", "strict", "score", "n"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name, row in result.per_category.items():
        table.add_row(name, f"{row['accuracy']:.1%}", f"{row['strict_accuracy']:.1%}", f"{row['score']:.3f}", str(row["n"]))
    table.add_section()
    geneval, strict = result.geneval, result.strict
    table.add_row("category mean", _with_ci(geneval.category_mean, geneval.category_mean_ci),
                  _with_ci(strict.category_mean, strict.category_mean_ci), f"{result.score:.3f}", str(result.n),
                  style="bold")
    table.add_row("per-sample mean", _with_ci(geneval.sample_mean, geneval.sample_mean_ci),
                  _with_ci(strict.sample_mean, strict.sample_mean_ci), "", str(result.n))
    Console().print(table)


def _with_ci(value: float, interval: tuple[float, float]) -> str:
    return f"{value:.1%} [{interval[0]:.1%}, {interval[1]:.1%}]"


def save_grid(images: np.ndarray, prompts: list[str], path: str | Path, per_prompt: int, cell: int = 96,
              max_rows: int = 24) -> Path:
    """One row per prompt (its text on the left), ``per_prompt`` samples across; uint8 ``[N,H,W,3]`` in."""
    rows = min(len(images) // per_prompt, max_rows)
    label_width = 260
    grid = Image.new("RGB", (label_width + per_prompt * cell, rows * cell), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for r in range(rows):
        draw.text((6, r * cell + cell // 2 - 6), prompts[r * per_prompt], fill="black", font=font)
        for c in range(per_prompt):
            tile = Image.fromarray(images[r * per_prompt + c]).resize((cell - 4, cell - 4), Image.NEAREST)
            grid.paste(tile, (label_width + c * cell + 2, r * cell + 2))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path

"""What people look at: the per-category accuracy table and labelled image grids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def print_eval_table(result, title: str = "") -> None:
    """Print overall and per-category accuracy/score as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for column in ("category", "accuracy", "score", "n"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name, row in result.per_category.items():
        table.add_row(name, f"{row['accuracy']:.1%}", f"{row['score']:.3f}", str(row["n"]))
    table.add_row("overall", f"{result.accuracy:.1%}", f"{result.score:.3f}", str(result.n), style="bold")
    Console().print(table)


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

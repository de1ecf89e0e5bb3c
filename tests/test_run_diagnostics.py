"""benchmarks/run_diagnostics.py: its table's first/last-window means and its --plot picture."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "run_diagnostics.py"


def _run(folder: Path, correct: list[float], kl: list[float] | None) -> Path:
    """A run folder whose metrics.jsonl has one validation row, then one row per training step."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "val/strict_accuracy": 0.25}]
    for step, value in enumerate(correct, 1):
        row = {"step": step, "reward/mean": value, "reward/correct": value, "actor/grad_norm": 0.01}
        if kl is not None:
            row["actor/approx_kl_step0"] = kl[step - 1]
        rows.append(row)
    rows.append({"step": len(correct), "val/strict_accuracy": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _load_script():
    """benchmarks/run_diagnostics.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("run_diagnostics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_means_and_plot(tmp_path):
    nft = _run(tmp_path / "nft", [0.2, 0.4, 0.6, 0.8], None)
    fg = _run(tmp_path / "fg", [0.1, 0.1, 0.3, 0.5], [1e-11, 2e-11, 3e-11, 4e-11])
    png = tmp_path / "out" / "runs.png"
    out = subprocess.run([sys.executable, str(SCRIPT), str(nft), str(fg), "--window", "2", "--plot", str(png)],
                         capture_output=True, text=True, check=True).stdout
    assert "| nft (4 steps) | reward/correct | 0.3 | 0.7 |" in out
    assert "| fg (4 steps) | actor/approx_kl_step0 | 1.5e-11 | 3.5e-11 |" in out
    assert "approx_kl" not in "".join(line for line in out.splitlines() if line.startswith("| nft"))
    with Image.open(png) as image:
        assert image.width > 1000 and image.height > 300


def test_a_folder_without_metrics_is_named(tmp_path):
    module = _load_script()
    with pytest.raises(SystemExit, match="metrics.jsonl does not exist"):
        module.metric_rows(tmp_path)


def test_step_profile_is_in_denoising_order_and_averages_the_run():
    module = _load_script()
    rows = [{"actor/clip_frac_step10": 0.4, "actor/clip_frac_step2": 0.1, "actor/clip_frac_step0": 0.0},
            {"actor/clip_frac_step10": 0.2, "actor/clip_frac_step2": 0.3, "actor/clip_frac_step0": 0.0}]
    steps, values = module.step_profile(rows, "clip_frac")
    assert steps == [0, 2, 10]
    assert values == pytest.approx([0.0, 0.2, 0.3])
    assert module.step_profile(rows, "approx_kl") == ([], [])

import json

import numpy as np
from PIL import Image

from flowloop.cli import main
from flowloop.models import EMBEDDED_MODEL
from flowloop.models.loading import load_tokenizer
from flowloop.models.prompt_ids import unknown_words
from flowloop.tasks import shapes


def test_eval_writes_json_and_grid(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    grid = tmp_path / "grid.png"
    code = main(["eval", "--model", str(tiny_model_dir), "--samples-per-prompt", "1", "--steps", "2",
                 "--json", str(out), "--grid", str(grid)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) == {"accuracy", "strict_accuracy", "score", "per_category", "n", "geneval", "strict", "bootstrap"}
    assert result["n"] == sum(len(shapes.split_prompts("heldout", c)) for c in shapes.CATEGORIES)
    assert set(result["per_category"]) == set(shapes.CATEGORIES)
    assert 0.0 <= result["strict_accuracy"] <= result["accuracy"] <= result["score"] <= 1.0
    assert Image.open(grid).size[0] > 100
    out = capsys.readouterr().out
    assert "category mean" in out and "per-sample mean" in out


def test_the_shipped_model_knows_every_word_of_the_shapes_world():
    """A world that grows a word needs the shipped weights retrained (`flowloop pretrain init=...`)."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL, "tokenizer")
    assert unknown_words(tokenizer, " ".join(shapes.VOCABULARY)) == []


def test_eval_of_the_embedded_model_writes_strict_and_geneval_with_intervals(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--samples-per-prompt", "2", "--steps", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("geneval", "strict"):
        figure = result[name]
        for mean in ("category_mean", "sample_mean"):
            low, high = figure[f"{mean}_ci"]
            assert 0.0 <= low <= figure[mean] <= high <= 1.0 and high > low
    assert result["geneval"]["category_mean"] == result["accuracy"]
    assert result["strict"]["category_mean"] == result["strict_accuracy"] <= result["accuracy"]
    assert result["bootstrap"] == {"resamples": 2000, "seed": 0, "confidence": 0.95, "unit": "sample",
                                   "category_mean": "stratified by category"}
    for category, row in result["per_category"].items():
        assert row["n"] == 2 * len(shapes.split_prompts("heldout", category))
        assert row["strict_accuracy"] <= row["accuracy"]
    assert "strict" in capsys.readouterr().out


def test_generate_writes_pngs(tiny_model_dir, tmp_path):
    code = main(["generate", "two red circles", "--out", str(tmp_path), "--num", "2", "--steps", "2",
                 "--model", str(tiny_model_dir), "--upscale", "1"])
    assert code == 0
    files = sorted(tmp_path.glob("*.png"))
    assert [f.name for f in files] == ["two_red_circles_seed0.png", "two_red_circles_seed1.png"]
    a, b = (np.asarray(Image.open(f)) for f in files)
    assert a.shape == (16, 16, 3) and not np.array_equal(a, b)


def test_bad_prompt_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    code = main(["generate", "two brown circles", "--out", str(tmp_path), "--model", str(tiny_model_dir)])
    assert code == 2
    assert "brown" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_bad_resolution_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    code = main(["generate", "a circle", "--out", str(tmp_path), "--model", str(tiny_model_dir), "--resolution", "18"])
    assert code == 2
    assert "patch_size=4" in capsys.readouterr().err


def test_bad_override_names_the_key(capsys):
    assert main(["pretrain", "stepz=3"]) == 2
    assert "unknown config key 'stepz'" in capsys.readouterr().err

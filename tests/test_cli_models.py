"""`flowloop generate` and `flowloop eval --prompts FILE --reward NAME` on every model family,
through the `FlowModel` protocol alone, on tiny random diffusers folders (2 ODE steps, 32 px)."""

import json

import pytest
from PIL import Image

from flowloop.cli import main
from tests.models import tiny_diffusers, tiny_diffusers_video

RES, FRAMES = 32, 5

FAMILIES = {
    "sd3": (tiny_diffusers.build_sd3, tiny_diffusers.PROMPTS[0], []),
    "flux": (tiny_diffusers.build_flux, tiny_diffusers.PROMPTS[0], []),
    "qwen_image": (tiny_diffusers_video.save_qwen_image, tiny_diffusers_video.PROMPTS[0], []),
    "wan": (tiny_diffusers_video.save_wan, tiny_diffusers_video.PROMPTS[0], ["--num-frames", str(FRAMES)]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    build, prompt, extra = FAMILIES[request.param]
    folder = build(tmp_path_factory.mktemp(request.param) / "model")
    return request.param, str(folder), prompt, extra


def test_generate_writes_one_file_per_seed_at_the_asked_size(family, tmp_path):
    name, folder, prompt, extra = family
    code = main(["generate", prompt, "--model", folder, "--out", str(tmp_path), "--num", "2", "--steps", "2",
                 "--resolution", str(RES), "--upscale", "1", *extra])
    assert code == 0
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == ([".gif"] * 2 if name == "wan" else [".png"] * 2)
    for path in files:
        with Image.open(path) as image:
            assert image.size == (RES, RES)
            assert getattr(image, "n_frames", 1) == (FRAMES if name == "wan" else 1)


def test_eval_scores_a_prompt_file_with_a_reward(family, tmp_path):
    name, folder, prompt, extra = family
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n")
    out, grid = tmp_path / "eval.json", tmp_path / "grid.png"
    code = main(["eval", "--model", folder, "--prompts", str(prompts), "--reward", "jpeg_compressibility",
                 "--samples-per-prompt", "2", "--steps", "2", "--resolution", str(RES), "--json", str(out),
                 "--grid", str(grid), *extra])
    assert code == 0
    metrics = json.loads(out.read_text())
    assert metrics["n"] == 2 and metrics["reward"] == "jpeg_compressibility"
    assert metrics["val/reward"] < 0 and metrics["val/reward/jpeg_kb"] > 0  # -kB / 500
    assert grid.is_file()


def test_eval_with_prompts_needs_a_reward(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a red circle\n")
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", str(tmp_path / "p.txt")]) == 2
    assert "--prompts FILE and --reward NAME go together" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", str(tmp_path / "p.txt"), "--reward", "nope"]) == 2
    assert "unknown reward 'nope'" in capsys.readouterr().err


def test_generate_on_the_embedded_model_upscales_small_images(tiny_model_dir, tmp_path):
    assert main(["generate", "a red circle", "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), "--num", "1",
                 "--steps", "2"]) == 0
    [path] = (tmp_path / "out").iterdir()
    size = json.loads((tiny_model_dir / "transformer" / "config.json").read_text())["sample_size"]
    with Image.open(path) as image:
        assert image.size == (4 * size, 4 * size)  # the model's own size, 4x

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from flowloop.models import EMBEDDED_MODEL, load_flow_model
from flowloop.models.tiny import TinyFlowModel


def _velocity(model, prompts, seed=0):
    ids, mask = model.tokenize(prompts)
    embeds = model.encode_prompt(ids, mask)
    x = torch.randn(len(prompts), *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(seed))
    return model.velocity(x, torch.full((len(prompts),), 0.7), embeds)


def test_save_and_load_round_trip_is_exact(tiny_model, tiny_model_dir):
    loaded = load_flow_model(tiny_model_dir)
    assert isinstance(loaded, TinyFlowModel)
    prompts = ["two red circles", "a blue square above a triangle"]
    with torch.no_grad():
        assert torch.equal(_velocity(tiny_model, prompts), _velocity(loaded, prompts))


def test_fp16_storage_stays_close(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "half")  # fp16 by default
    loaded = load_flow_model(tmp_path / "half")
    assert next(loaded.transformer.parameters()).dtype == torch.float32
    with torch.no_grad():
        a, b = _velocity(tiny_model, ["a green triangle"]), _velocity(loaded, ["a green triangle"])
    assert (a - b).abs().max() < 1e-2
    assert not torch.equal(a, b)


def test_bf16_weights_take_and_return_float32_latents(tiny_model_dir):
    """bf16 rollouts (``model.dtype=bfloat16``): the DiT runs in bf16, the step math stays float32."""
    full, half = load_flow_model(tiny_model_dir), load_flow_model(tiny_model_dir, dtype=torch.bfloat16)
    assert next(half.transformer.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        a, b = _velocity(full, ["a green triangle"]), _velocity(half, ["a green triangle"])
    assert b.dtype == torch.float32
    assert 0 < (a - b).abs().max() < 0.1 * a.abs().max()


def test_tokenizer_is_fast_with_chat_template(tiny_model_dir):
    model = load_flow_model(tiny_model_dir)
    assert isinstance(model.tokenizer, PreTrainedTokenizerFast)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Two RED circles"}], tokenize=False)
    assert model.tokenizer.convert_ids_to_tokens(model.tokenizer(ids, add_special_tokens=False).input_ids) == [
        "[BOS]", "two", "red", "circles"
    ]
    padded, mask = model.tokenize(["a circle", "two red circles"])
    assert padded.shape == (2, model.max_sequence_length)
    assert mask.sum(1).tolist() == [3, 4]


def test_prompt_changes_the_velocity(tiny_model):
    with torch.no_grad():
        v = _velocity(tiny_model, ["a red circle", "a blue square"], seed=1)
        same_noise = _velocity(tiny_model, ["a red circle", "a red circle"], seed=1)
    assert torch.equal(v[0], same_noise[0])
    assert not torch.allclose(v[1], same_noise[1])


def test_unknown_word_and_long_prompt_are_errors(tiny_model):
    with pytest.raises(ValueError, match="brown"):
        tiny_model.tokenize(["two brown circles"])
    with pytest.raises(ValueError, match="max_sequence_length=16"):
        tiny_model.tokenize([" ".join(["a red circle and"] * 5) + " a square"])


@pytest.mark.parametrize("height,width,match", [(16, 12, "not square"), (18, 18, "patch_size=4"), (0, 0, "patch_size")])
def test_bad_resolution_names_the_problem(tiny_model, height, width, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.latent_shape(height, width)


def test_video_frames_rejected(tiny_model):
    with pytest.raises(ValueError, match="num_frames"):
        tiny_model.latent_shape(16, 16, num_frames=4)


@pytest.mark.parametrize(
    "remove,match",
    [
        ("transformer/diffusion_pytorch_model.safetensors", "no weights file"),
        ("transformer/config.json", "transformer/config.json is missing"),
        ("tokenizer/tokenizer.json", "tokenizer.json is missing"),
        ("model_index.json", "model_index.json is missing"),
    ],
)
def test_missing_file_is_named(tiny_model_dir, remove, match):
    (tiny_model_dir / remove).unlink()
    with pytest.raises(FileNotFoundError, match=match):
        load_flow_model(tiny_model_dir)


def test_not_a_folder_and_unknown_pipeline(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="no hub ids"):
        load_flow_model(tmp_path / "org/model-name")
    index = json.loads((tiny_model_dir / "model_index.json").read_text())
    index["_class_name"] = "StableCascadePipeline"
    (tiny_model_dir / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"supported: \[.*'FlowloopTinyPipeline'.*'StableDiffusion3Pipeline'"):
        load_flow_model(tiny_model_dir)


@pytest.mark.skipif(not EMBEDDED_MODEL.exists(), reason="embedded model not built yet")
def test_embedded_model_ships_small_and_loads():
    size = sum(p.stat().st_size for p in EMBEDDED_MODEL.rglob("*") if p.is_file())
    assert size < 30 * 2**20
    model = load_flow_model()
    assert model.latent_shape(32, 32) == (3, 32, 32)
    weights = load_file(EMBEDDED_MODEL / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(w.dtype == torch.float16 for w in weights.values())


def test_unknown_model_option_names_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.options \['guidance'\] are not options of TinyFlowModel; it takes \[\]"):
        load_flow_model(tiny_model_dir, guidance=3.5)

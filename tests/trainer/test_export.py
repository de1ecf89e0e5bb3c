"""`flowloop export` round trips: a checkpoint written by the real save path, exported, loaded back
by diffusers (``load_lora_weights``, ``from_pretrained``) and peft, gives the images flowloop's own
trained model gives."""

from __future__ import annotations

import pytest
import torch

from flowloop.cli import main
from flowloop.models import load_flow_model, load_trained_weights
from flowloop.models.trained import TrainedWeights
from flowloop.rollout import RolloutEngine, RolloutRequest
from flowloop.rollout.types import SamplingParams
from flowloop.trainer.checkpoint import save_checkpoint
from flowloop.trainer.export import export
from tests.models.tiny_diffusers import PROMPTS, build_flux, build_sd3, prompt_ids

TOKENS = 16
FAMILIES = {
    "sd3": (build_sd3, "StableDiffusion3Pipeline", {}, {}),
    "flux": (build_flux, "FluxPipeline", {"guidance": 3.5}, {"guidance_scale": 3.5}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    build = FAMILIES[request.param][0]
    return request.param, build(tmp_path_factory.mktemp(request.param) / "model")


def _load(family_name, folder):
    return load_flow_model(folder, max_sequence_length=TOKENS, **FAMILIES[family_name][2])


def _pipeline(family_name, folder, **components):
    import diffusers

    return getattr(diffusers, FAMILIES[family_name][1]).from_pretrained(folder, **components)


def _pipeline_images(family_name, pipe) -> torch.Tensor:
    """Two prompts, 2 Euler steps, seed 0, as a diffusers user would call the pipeline."""
    with torch.no_grad():
        return pipe(PROMPTS, height=32, width=32, num_inference_steps=2, max_sequence_length=TOKENS, output_type="pt",
                    generator=torch.Generator().manual_seed(0), **({"guidance_scale": 1.0} | FAMILIES[family_name][3])).images


def _flowloop_images(model) -> torch.Tensor:
    """The same prompts through flowloop's own engine (ODE, fixed seeds)."""
    ids, mask = prompt_ids(model, PROMPTS)
    requests = [RolloutRequest(f"r{k}", ids[k][mask[k].bool()], SamplingParams(
        height=32, width=32, num_inference_steps=2, sampler="ode", logprobs=False, seed=k)) for k in range(len(PROMPTS))]
    return torch.stack([out.diffusion_output for out in RolloutEngine(model, cpu_shards=1).sample(requests)])


def _lora_checkpoint(family_name, folder, run_dir):
    """Adapters of rank 4, alpha 8 (scale 2) added as training adds them, moved off their zero
    start, and saved as `flowloop train` saves them."""
    from flowloop.models import flux, sd3
    from flowloop.models.lora import add_lora

    targets = {"sd3": sd3.LORA_TARGETS, "flux": flux.LORA_TARGETS}[family_name]
    model = _load(family_name, folder)
    add_lora(model.transformer, 4, 8, targets)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.transformer.named_parameters():
            if "lora_B" in name:  # zero at the start: a trained adapter is not
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    state = {k: v for k, v in model.transformer.state_dict().items() if "lora_" in k}
    description = TrainedWeights(model_path=str(folder), family=family_name, dtype="float32", finetune="lora",
                                 lora={"rank": 4, "alpha": 8, "target_modules": list(targets)})
    return model, save_checkpoint(run_dir, 1, state, description=description)


def test_lora_export_loads_in_diffusers_and_peft_with_the_same_images(family, tmp_path):
    from peft import PeftModel

    name, folder = family
    trained, checkpoint = _lora_checkpoint(name, folder, tmp_path / "run")
    expected = _flowloop_images(trained)
    assert (_flowloop_images(_load(name, folder)) - expected).abs().max() > 1e-3  # the adapters change the images
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0  # a run folder: its newest checkpoint
    assert {"adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors"} <= {
        p.name for p in out.iterdir()}

    # 1. diffusers' own loader: the pipeline's images are those of the pipeline around flowloop's trained denoiser.
    pipe = _pipeline(name, folder)
    pipe.load_lora_weights(out)
    reference = _pipeline(name, folder, transformer=trained.transformer)
    torch.testing.assert_close(_pipeline_images(name, pipe), _pipeline_images(name, reference), rtol=0, atol=1e-5)
    # ... and flowloop's engine around the diffusers-loaded denoiser gives flowloop's trained images.
    fresh = _load(name, folder)
    fresh.transformer = pipe.transformer
    torch.testing.assert_close(_flowloop_images(fresh), expected, rtol=0, atol=1e-5)

    # 2. peft's own loader on a fresh base denoiser.
    fresh = _load(name, folder)
    PeftModel.from_pretrained(fresh.transformer, str(out))  # injects the adapters in place
    torch.testing.assert_close(_flowloop_images(fresh), expected, rtol=0, atol=1e-5)

    # 3. The checkpoint alone (its flowloop.json) rebuilds the trained model: no run config needed.
    (tmp_path / "run" / "config.yaml").unlink(missing_ok=True)
    torch.testing.assert_close(_flowloop_images(load_trained_weights(_load(name, folder), checkpoint)), expected,
                               rtol=0, atol=1e-6)


def test_full_export_is_a_diffusers_folder_with_the_trained_denoiser(family, tmp_path):
    name, folder = family
    trained = _load(name, folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trained.transformer.parameters():  # a stand-in for a full fine-tune's update
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    description = TrainedWeights(model_path=str(folder), family=name, dtype="float32", finetune="full")
    checkpoint = save_checkpoint(tmp_path / "run", 3, trained.transformer.state_dict(), description=description)
    out = tmp_path / "export"
    export(checkpoint, out)

    denoiser_class = type(trained.transformer)
    loaded = denoiser_class.from_pretrained(out, subfolder="transformer")
    reference = _pipeline(name, folder, transformer=trained.transformer)
    torch.testing.assert_close(_pipeline_images(name, _pipeline(name, out)), _pipeline_images(name, reference), rtol=0, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trained.transformer.state_dict().values()))
    torch.testing.assert_close(_flowloop_images(_load(name, out)), _flowloop_images(trained), rtol=0, atol=1e-5)


def test_the_embedded_model_exports_to_a_folder_flowloop_loads(tmp_path):
    trained = load_flow_model()
    with torch.no_grad():
        next(trained.trainable_module().parameters()).add_(0.1)
    description = TrainedWeights(model_path=None, family="tiny", dtype="float32", finetune="full")
    save_checkpoint(tmp_path / "run", 2, trained.trainable_module().state_dict(), description=description)
    export(tmp_path / "run", tmp_path / "export")
    loaded = load_flow_model(tmp_path / "export").trainable_module()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trained.trainable_module().state_dict().values()))


def test_a_corrupted_checkpoint_is_refused_naming_the_file(tmp_path, capsys):
    description = TrainedWeights(model_path=None, family="tiny", dtype="float32", finetune="full")
    checkpoint = save_checkpoint(tmp_path / "run", 1, {"w": torch.zeros(4)}, description=description)
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match its sha256"):
        export(checkpoint, tmp_path / "out")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2  # no valid checkpoint left
    assert "no valid checkpoint" in capsys.readouterr().err


def test_a_runs_config_describes_its_weights(tmp_path):
    from types import SimpleNamespace

    from flowloop.trainer.checkpoint import describe_weights

    model = SimpleNamespace(path=None, dtype="float32")  # the config's model and actor sections
    actor = SimpleNamespace(finetune="lora", lora_rank=4, lora_alpha=8, lora_target_modules=["qkv", "proj"])
    description = describe_weights(model, actor)
    assert (description.model_path, description.family, description.dtype, description.finetune) == (None, "tiny", "float32", "lora")
    assert description.lora == {"rank": 4, "alpha": 8, "target_modules": ["qkv", "proj"]}
    checkpoint = save_checkpoint(tmp_path / "run", 1, {"w": torch.zeros(1)}, description=description)
    assert TrainedWeights.read(checkpoint) == description  # flowloop.json is written, hashed in the manifest, read back
    assert "flowloop.json" in (checkpoint / "manifest.json").read_text()

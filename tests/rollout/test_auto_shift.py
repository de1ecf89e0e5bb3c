"""``shift: auto``: the sigma grid the model's own scheduler config gives at the sampled resolution,
checked against diffusers' ``FlowMatchEulerDiscreteScheduler`` driven as the FLUX and Qwen-Image
pipelines drive it (``calculate_shift`` of the pipeline's image token count, then ``set_timesteps(mu=...)``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowloop.config import load_config
from flowloop.config.rollout import RolloutConfig
from flowloop.models import load_flow_model
from flowloop.rollout import RolloutEngine, RolloutRequest
from flowloop.rollout.engine import model_sigmas
from flowloop.rollout.types import SamplingParams
from flowloop.sampling import sigmas
from tests.models.tiny_diffusers import build_flux, build_sd3, prompt_ids
from tests.models.tiny_diffusers_video import save_qwen_image

STEPS = 6
RESOLUTIONS = [(32, 32), (64, 96)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto_shift")
    return {"FluxPipeline": build_flux(root / "flux"), "QwenImagePipeline": save_qwen_image(root / "qwen")}


def _pipeline_sigmas(folder, pipeline_class: str, height: int, width: int) -> torch.Tensor:
    """The sigmas the diffusers pipeline samples with at ``height x width`` (final 0 included)."""
    import diffusers
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    pipe = getattr(diffusers, pipeline_class).from_pretrained(folder)
    channels = pipe.transformer.config.in_channels // 4
    latents = pipe.prepare_latents(1, channels, height, width, torch.float32, "cpu", torch.Generator().manual_seed(0))
    latents = latents[0] if isinstance(latents, tuple) else latents
    config = pipe.scheduler.config
    mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    pipe.scheduler.set_timesteps(STEPS, sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    return pipe.scheduler.sigmas.float()


@pytest.mark.parametrize("pipeline_class", ["FluxPipeline", "QwenImagePipeline"])
@pytest.mark.parametrize("height, width", RESOLUTIONS)
def test_auto_is_the_pipelines_dynamic_shift(folders, pipeline_class, height, width):
    model = load_flow_model(folders[pipeline_class])
    assert model.scheduler_shift.dynamic
    ours = model_sigmas(model, SamplingParams(height=height, width=width, num_inference_steps=STEPS, shift="auto"))
    torch.testing.assert_close(ours, _pipeline_sigmas(folders[pipeline_class], pipeline_class, height, width),
                               rtol=0, atol=1e-6)


def test_auto_follows_the_resolution_and_a_float_shift_still_works(folders):
    model = load_flow_model(folders["FluxPipeline"])
    small, large = (model_sigmas(model, SamplingParams(height=h, width=w, num_inference_steps=STEPS, shift="auto"))
                    for h, w in RESOLUTIONS)
    assert (large[1:-1] > small[1:-1]).all()  # more image tokens: more steps at high noise
    assert torch.equal(model_sigmas(model, SamplingParams(num_inference_steps=STEPS, shift=3.0)), sigmas(STEPS, 3.0))


def test_the_engine_samples_auto_as_the_shift_it_resolves_to(folders):
    """FLUX (no terminal stretch): ``auto`` at 32x32 gives the samples of its numeric exp(mu)."""
    model = load_flow_model(folders["FluxPipeline"], max_sequence_length=16)
    rule = model.scheduler_shift
    tokens = model.image_seq_len(32, 32)  # 8 x 8 packed tokens
    mu = rule.base_shift + (rule.max_shift - rule.base_shift) / (rule.max_seq_len - rule.base_seq_len) * (tokens - rule.base_seq_len)
    ids, mask = prompt_ids(model, ["a red cat"])

    def sample(shift):
        params = SamplingParams(height=32, width=32, num_inference_steps=3, sampler="ode", logprobs=False, seed=0, shift=shift)
        return RolloutEngine(model, cpu_shards=1).sample([RolloutRequest("r", ids[0][mask[0].bool()], params)])[0]

    torch.testing.assert_close(sample("auto").diffusion_output, sample(math.exp(mu)).diffusion_output, rtol=0, atol=1e-6)


def test_fixed_shift_schedulers_and_models_without_one(tmp_path):
    sd3 = load_flow_model(build_sd3(tmp_path / "sd3"), max_sequence_length=16)
    assert not sd3.scheduler_shift.dynamic and sd3.scheduler_shift.shift == 3.0
    assert torch.equal(model_sigmas(sd3, SamplingParams(num_inference_steps=STEPS, shift="auto")), sigmas(STEPS, 3.0))
    tiny = load_flow_model()  # the embedded model has no scheduler: auto is the linear grid
    assert torch.equal(model_sigmas(tiny, SamplingParams(num_inference_steps=STEPS, shift="auto")), sigmas(STEPS))


@pytest.mark.parametrize("override, ok", [("pipeline.shift=auto", True), ("pipeline.shift=2.5", True),
                                          ("pipeline.shift=fast", False), ("pipeline.shift=0", False),
                                          ("val_kwargs.pipeline.shift=fast", False)])
def test_config_takes_auto_or_a_positive_number(override, ok):
    if ok:
        assert load_config(RolloutConfig, [override]).pipeline.shift in ("auto", 2.5)
    else:
        with pytest.raises(ValueError, match="shift must be a number > 0 or 'auto'"):
            load_config(RolloutConfig, [override])

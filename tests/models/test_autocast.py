"""`model.autocast`: float32 LoRA adapters whose matmuls run in the bf16 model's dtype, in the
rollout and the replay alike, while the optimizer steps float32 weights."""

from __future__ import annotations

import copy

import pytest
import torch

from flowloop.config import load_config
from flowloop.config.train import TrainConfig
from flowloop.models import load_flow_model
from flowloop.models.autocast import autocast_forward
from flowloop.models.sd3 import LORA_TARGETS
from tests.models.test_sd3 import T5_TOKENS, sd3_dir  # noqa: F401  (the tiny SD3 folder fixture)
from tests.models.tiny_diffusers import PROMPTS, prompt_ids, rollout


def adapter_output_dtypes(model) -> set[torch.dtype]:
    """The dtypes the LoRA ``lora_A`` layers produce in one forward of ``model``."""
    seen = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for name, m in model.transformer.named_modules() if name.endswith("lora_A.default")]
    embeds = model.encode_prompt(*prompt_ids(model, PROMPTS))
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    with torch.no_grad():
        model.velocity(x, torch.full((2,), 0.7), embeds)
    for hook in hooks:
        hook.remove()
    return seen


def test_adapters_stay_float32_run_in_bf16_and_the_update_replays_the_rollout(sd3_dir):  # noqa: F811
    from flowloop.config.actor import ActorConfig
    from flowloop.trainer.actor import Actor

    model = load_flow_model(sd3_dir, dtype="bfloat16", max_sequence_length=T5_TOKENS)
    batch, sampling = rollout(model)
    config = ActorConfig(finetune="lora", lora_rank=4, lora_alpha=8, lora_target_modules=list(LORA_TARGETS), lr=1e-2,
                         micro_batch_size=len(batch), mini_batch_size=len(batch))
    actor = Actor(model, config, sampling)
    adapters = {k: v for k, v in model.transformer.named_parameters() if "lora_" in k}
    with torch.no_grad():  # adapters that change the output, so their branch's precision shows
        for name, value in adapters.items():
            if "lora_B" in name:
                value.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    assert adapter_output_dtypes(model) == {torch.float32}
    autocast_forward(model.transformer, "bfloat16")
    assert adapter_output_dtypes(model) == {torch.bfloat16}
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
    assert adapter_output_dtypes(copy.deepcopy(model)) == {torch.bfloat16}  # a copy keeps it, on itself

    batch, sampling = rollout(model)
    before = {k: v.detach().clone() for k, v in adapters.items()}
    metrics = actor.update(batch, torch.tensor([1.0, -1.0] * (len(batch) // 2)), torch.Generator().manual_seed(0))
    assert metrics["rollout_correction/max"] <= 1e-5  # the replay computes what the rollout computed
    assert all(v.dtype == torch.float32 for v in adapters.values())
    assert any((adapters[k] - before[k]).abs().max() > 0 for k in adapters)


def test_autocast_of_a_float32_model_is_an_error_naming_the_keys():
    with pytest.raises(ValueError, match="model.autocast needs model.dtype bfloat16"):
        load_config(TrainConfig, ["model.autocast=true"]).validate()


def test_sd3_recipe_trains_a_step_in_bf16_under_autocast(tmp_path):
    """Through `flowloop train`'s code path (the worker applies it after LoRA): one step of the
    SD3.5 recipe in bf16 whose rollout the update replays."""
    from tests.models.test_family_recipes import train_one_step

    _, cfg, rows = train_one_step("sd3", tmp_path, "model.dtype=bfloat16", "model.autocast=true")
    assert cfg.model.autocast and cfg.model.dtype == "bfloat16" and cfg.actor.finetune == "lora"
    assert rows[1]["rollout_correction/max"] <= 1e-5 and rows[1]["actor/grad_norm"] > 0

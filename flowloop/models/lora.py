"""LoRA adapters on a denoiser (peft, through diffusers' ``PeftAdapterMixin.add_adapter``).

Lives in the models layer because both sides need the same adapters: the trainer adds them to
train, and loading a trained checkpoint adds them again (from the settings the checkpoint
records) before the weights go in.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from flowloop.extras import require

__all__ = ["add_lora", "lora_targets"]


def lora_targets(module: nn.Module, target_modules: Sequence[str]) -> list[str]:
    """Names of ``module``'s linear layers that are, or end in ``.``, one of ``target_modules``.

    A list that matches no linear layer is a ValueError listing the suffixes that exist, not a
    silent run with nothing to train.
    """
    linear = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    targets = [name for name in linear if any(name == t or name.endswith("." + t) for t in target_modules)]
    if not targets:
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ValueError(f"actor.lora_target_modules={list(target_modules)} match no linear layer of "
                         f"{type(module).__name__}; its linear layers end in {suffixes}")
    return targets


def add_lora(module: nn.Module, rank: int, alpha: float, target_modules: Sequence[str]) -> list[str]:
    """Freeze ``module`` and add trainable LoRA adapters (rank ``rank``, scale ``alpha / rank``)
    to the linear layers `lora_targets` picks; returns the adapted module names.

    The adapters are float32 even on a bf16/fp16 base (as flow_grpo keeps them): AdamW steps of
    lr ~1e-4 are below bf16's resolution for most weights and would round away. peft runs the
    adapter branch in the adapters' dtype and casts the sum back to the base layer's.
    """
    peft = require("peft", "LoRA fine-tuning (actor.finetune=lora)")
    if not hasattr(module, "add_adapter"):
        raise ValueError(f"{type(module).__name__} cannot take LoRA adapters (it lacks diffusers' PeftAdapterMixin)")
    targets = lora_targets(module, target_modules)
    module.requires_grad_(False)
    module.add_adapter(peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True))
    for param in module.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return targets

"""LoRA on the denoiser through peft (extra ``peft``): add adapters, switch them off for the reference.

The adapters go on the denoiser in place (diffusers' ``PeftAdapterMixin.add_adapter``), so the
rollout engine, which holds the same module, samples with them at once: colocated, nothing to
copy. The frozen base model, the KL reference, is the same module with the adapters disabled.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from flowloop.extras import require


def add_lora(module: nn.Module, config) -> list[str]:
    """Freeze ``module`` and add trainable LoRA adapters to its linear layers whose names end in
    one of ``config.lora_target_modules``; returns the adapted module names.

    The adapters are float32 even on a bf16/fp16 base (as flow_grpo keeps them): AdamW steps of
    lr ~1e-4 are below bf16's resolution for most weights and would round away. peft runs the
    adapter branch in the adapters' dtype and casts the sum back to the base layer's.

    A target list that matches no linear layer is a ValueError listing the names that exist,
    not a silent run with nothing to train.
    """
    peft = require("peft", "LoRA fine-tuning (actor.finetune=lora)")
    if not hasattr(module, "add_adapter"):
        raise ValueError(f"{type(module).__name__} cannot take LoRA adapters (it lacks diffusers' PeftAdapterMixin)")
    linear = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    targets = [name for name in linear if any(name == t or name.endswith("." + t) for t in config.lora_target_modules)]
    if not targets:
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ValueError(f"actor.lora_target_modules={list(config.lora_target_modules)} match no linear layer of "
                         f"{type(module).__name__}; its linear layers end in {suffixes}")
    module.requires_grad_(False)
    module.add_adapter(peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=targets,
                                       init_lora_weights=True))
    for param in module.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return targets


@contextmanager
def adapters_disabled(module: nn.Module):
    """Run the base model: LoRA adapters off inside the block, back on after it."""
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()

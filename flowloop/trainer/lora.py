"""LoRA on the denoiser during training: add adapters from the actor config, switch them off for
the reference.

The adapters go on the denoiser in place (`flowloop.models.lora.add_lora`), so the rollout
engine, which holds the same module, samples with them at once: colocated, nothing to copy. The
frozen base model, the KL reference, is the same module with the adapters disabled.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from flowloop.models import lora


def add_lora(module: nn.Module, config) -> list[str]:
    """Freeze ``module`` and add the adapters ``config`` (``lora_rank``, ``lora_alpha``,
    ``lora_target_modules``) asks for; returns the adapted module names (`flowloop.models.lora`)."""
    return lora.add_lora(module, config.lora_rank, config.lora_alpha, config.lora_target_modules)


@contextmanager
def adapters_disabled(module: nn.Module):
    """Run the base model: LoRA adapters off inside the block, back on after it."""
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()

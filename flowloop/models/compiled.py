"""Regional compilation: ``torch.compile`` on each repeated transformer block of a denoiser.

A DiT is a stack of identical blocks, so compiling one block's code gives a graph every block
reuses (torch inlines the blocks' parameters as inputs): compile time is that of one block, not
of the whole model, and the rest (embeddings, final layer) stays eager. The rollout and the
update run the same compiled blocks, LoRA adapters inside them, with gradient checkpointing too.

An image VAE's decoder (a diffusers ``AutoencoderKL``: SD3, FLUX) is compiled whole: the rollout
decodes every sample once, and eager it costs a tenth of the denoising loop's time at 512x512
(measured with benchmarks/vae_decode.py). It has no gradients and no adapters, so its graph is
small; video VAEs decode frame by frame with a Python-side cache and stay eager.

``rollout_only`` compiles the blocks for calls made without gradients (the rollout, the bare
forward, a KL reference forward) and leaves the update's backward-carrying calls eager: the
rollout samples at the compiled speed while the update keeps eager kernels and no backward
graphs to compile. Those graphs specialize on each batch shape (``dynamic=False``): a rollout's
batches come in few shapes, and with dynamic shapes Qwen-Image's compiled loop ran no faster
than eager. Each new shape (batch rows, text length) compiles once.

Every graph a block's code holds counts against one limit (torch's ``recompile_limit``, 8 by
default), shared by all the blocks of a stack, and past it the block runs eager without a word
beyond one log warning. A stack needs more than 8: SD3.5-Medium's blocks come in three layouts
(dual attention, plain, the last block's context-free one), each traced for the rollout, for the
KL reference (adapters off, a different module state) and for the update, and the update's first
block once more (its input carries no gradient): 10 graphs. With the default, SD3.5's
first RL step hit the limit on an H100 and, on a small SD3 with the same layouts, the update's
plain and last blocks then ran eager. ``RECOMPILE_LIMIT`` leaves room for those and a few batch
shapes; each text length is a graph too (for the rollout, and with the update compiled for its
forward and backward), so a model that cuts its text to the batch's longest prompt pads it to
`TEXT_LENGTH_MULTIPLE` (`bucket_text_lengths`).
"""

from __future__ import annotations

import torch
from torch import nn

TEXT_LENGTH_MULTIPLE = 64
"""What `bucket_text_lengths` rounds a model's text rows up to: prompts of 1-64 tokens share one
graph, 65-128 the next; at most 63 padded tokens beside Qwen-Image's 1024 image tokens at 512x512."""

RECOMPILE_LIMIT = 64
"""Graphs a compiled block's code may hold before torch falls back to eager (raised to this, never
lowered): layouts x call kinds (rollout, KL reference, update) x batch shapes."""


def compile_repeated_blocks(module: nn.Module, rollout_only: bool = False) -> int:
    """Compile, in place, every block of each ``nn.ModuleList`` of ``module`` that holds two or
    more blocks of one class (the classes in diffusers' ``_repeated_blocks`` when the model names
    them), for every call or (``rollout_only``) for calls without gradients; returns how many
    blocks were compiled. ValueError when there are none."""
    named = set(getattr(module, "_repeated_blocks", None) or ())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = 0
    for stack in module.modules():
        if not isinstance(stack, nn.ModuleList) or len(stack) < 2:
            continue
        kinds = {type(block) for block in stack}
        if len(kinds) != 1 or (named and next(iter(kinds)).__name__ not in named):
            continue
        for block in stack:
            _compile_without_grad(block) if rollout_only else block.compile()
            compiled += 1
    if not compiled:
        raise ValueError(f"model.compile: {type(module).__name__} has no stack of repeated blocks to compile; "
                         "set model.compile=false")
    return compiled


def bucket_text_lengths(model) -> bool:
    """Make ``model`` pad its text rows to a multiple of `TEXT_LENGTH_MULTIPLE` when it cuts them to
    the batch's longest prompt (Qwen-Image's ``text_length_multiple``); whether it does. Without
    it every new prompt length is a new shape to the compiled blocks, whose graph then compiles
    inside a training step (with ``rollout_only``, one graph a length until `RECOMPILE_LIMIT`)."""
    if not hasattr(model, "text_length_multiple"):
        return False
    model.text_length_multiple = TEXT_LENGTH_MULTIPLE
    return True


def _compile_without_grad(block: nn.Module) -> None:
    """Route ``block``'s calls made with gradients off to a compiled copy of its forward."""
    eager = block.forward
    compiled = torch.compile(eager, dynamic=False)

    def forward(*args, **kwargs):
        return eager(*args, **kwargs) if torch.is_grad_enabled() else compiled(*args, **kwargs)

    block.forward = forward


def compile_image_decoder(model) -> bool:
    """Compile, in place, the decoder of ``model.vae`` when it is a diffusers ``AutoencoderKL``;
    whether it did. Only the decode's last bits change (bf16 images within a few 1e-2 of eager's
    on random weights); no log-prob depends on them."""
    vae = getattr(model, "vae", None)
    if type(vae).__name__ != "AutoencoderKL":
        return False
    vae.decoder.compile()
    return True

"""What every diffusers-backed adapter (SD3, FLUX, Qwen-Image, Wan) does the same way.

Checking a pipeline folder before loading it, loading frozen components, giving a pipeline's
tokenizer the chat template the agent loop needs, re-tokenizing a prompt for a second text
encoder, checking a resolution, and moving latents in and out of the VAE's scale. The adapters
differ in how they encode text and call their denoiser; everything here is what they share.

The multi-tokenizer trick: a `FlowModel` exposes one tokenizer, whose ids travel through the
rollout layer (the agent loop tokenizes the chat-templated prompt; the engine pads the ids).
Pipelines with more than one text encoder (SD3: CLIP-L, CLIP-G, T5; FLUX: CLIP-L, T5) pick
their main tokenizer as ``model.tokenizer`` and, inside ``encode_prompt``, decode its ids back
to text (`decode_prompts`) and tokenize that text again for the other encoders
(`tokenize_like_pipeline`), exactly as the diffusers pipeline tokenizes the raw prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from flowloop.models.loading import load_component, load_tokenizer, read_model_index, require_component_files

__all__ = [
    "CLIP_TOKENS",
    "USER_CONTENT_TEMPLATE",
    "check_pipeline_folder",
    "check_resolution",
    "decode_prompts",
    "ensure_chat_template",
    "frozen",
    "latents_to_vae",
    "load_frozen",
    "load_prompt_tokenizer",
    "tokenize_like_pipeline",
    "to_unit_images",
    "vae_scale_factor",
    "vae_to_latents",
    "valid_tokens_first",
]

CLIP_TOKENS = 77
"""CLIP's context length: SD3's and FLUX's pipelines pad and truncate their CLIP prompts to it."""

USER_CONTENT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}{% endif %}{% endfor %}"
)
"""Chat template for a pipeline tokenizer that has none: the text is the user's content, verbatim,
so the ids are those the diffusers pipeline would feed its text encoder for the raw prompt."""


# ---------------------------------------------------------------------------------------------
# Folders and components
# ---------------------------------------------------------------------------------------------


def check_pipeline_folder(
    root: str | Path,
    pipeline_class: str | Sequence[str],
    models: Sequence[str],
    tokenizers: Sequence[str] = (),
) -> dict:
    """Check a local pipeline folder before loading anything; return its ``model_index.json``.

    ``pipeline_class``: the ``_class_name`` (or names) the adapter accepts. ``models``: component
    sub-folders that need ``config.json`` + weights (``transformer``, ``vae``, ``text_encoder``...);
    ``tokenizers``: sub-folders that need ``tokenizer.json``. Every component is checked first,
    so a half-copied checkpoint fails with the missing file's path, not minutes into a load.
    """
    index = read_model_index(root)
    accepted = [pipeline_class] if isinstance(pipeline_class, str) else list(pipeline_class)
    if index.get("_class_name") not in accepted:
        raise ValueError(f"{root}/model_index.json names {index.get('_class_name')!r}; this adapter loads {accepted}")
    for name in models:
        require_component_files(root, name)
    for name in tokenizers:
        needed = Path(root) / name / "tokenizer.json"
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} is missing: the model folder's '{name}' component is incomplete.")
    return index


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode with no gradients: text encoders and VAEs never train in RL."""
    return module.eval().requires_grad_(False)


def load_frozen(root: str | Path, subfolder: str, cls, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """Load component ``root/subfolder`` as ``cls`` in ``dtype`` on ``device``, frozen (see `frozen`)."""
    return frozen(load_component(root, subfolder, cls, dtype).to(device))


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


def ensure_chat_template(tokenizer, append_eos: bool = False):
    """Give ``tokenizer`` `USER_CONTENT_TEMPLATE` if it has no chat template; return it.

    ``append_eos``: end the text with the tokenizer's EOS token, for pipelines that tokenize with
    ``add_special_tokens=True`` (T5 appends ``</s>``): the agent loop tokenizes the templated
    text with ``add_special_tokens=False``, so the template must add what the pipeline would.
    A tokenizer that already has a template (Qwen's) keeps it.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    template = USER_CONTENT_TEMPLATE
    if append_eos:
        if tokenizer.eos_token is None:
            raise ValueError(f"{type(tokenizer).__name__} has no eos_token to append to the prompt")
        template += "{{ eos_token }}"
    tokenizer.chat_template = template
    return tokenizer


def load_prompt_tokenizer(root: str | Path, subfolder: str, max_length: int, append_eos: bool = False):
    """The tokenizer the rollout layer sees (``FlowModel.tokenizer``): loaded from
    ``root/subfolder``, with a chat template (`ensure_chat_template`) and ``model_max_length``
    set to ``max_length``, the adapter's prompt length."""
    if max_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_length}")
    tokenizer = ensure_chat_template(load_tokenizer(root, subfolder), append_eos=append_eos)
    tokenizer.model_max_length = max_length
    return tokenizer


def decode_prompts(tokenizer, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """Ids ``[B, L]`` (padded, with ``attention_mask``) -> the prompts' text, special tokens dropped.

    The first half of the multi-tokenizer trick (see the module docstring): what the other text
    encoders' tokenizers should see is the text the ids came from.
    """
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), attention_mask.cpu())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def tokenize_like_pipeline(tokenizer, texts: list[str], max_length: int, add_special_tokens: bool = True):
    """Tokenize ``texts`` as diffusers' pipelines do for a text encoder: padded to ``max_length``
    (77 for CLIP), longer text truncated (CLIP's limit; the pipelines warn and cut too).
    Returns ``(input_ids, attention_mask)``, each ``[B, max_length]``."""
    enc = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=add_special_tokens, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


# ---------------------------------------------------------------------------------------------
# Resolution, VAE scaling, images
# ---------------------------------------------------------------------------------------------


def check_resolution(height: int, width: int, multiple: int) -> None:
    """Raise a ValueError naming ``height``/``width`` unless both are positive multiples of ``multiple``
    (the VAE's downsampling times the denoiser's patch size)."""
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value < multiple or value % multiple:
            raise ValueError(
                f"{name}={value} must be a positive multiple of {multiple} (VAE scale factor x patch size); "
                f"try {max(multiple, (int(value) // multiple) * multiple)}"
            )


def vae_scale_factor(vae) -> int:
    """Pixels per latent cell of an ``AutoencoderKL``: ``2 ** (len(block_out_channels) - 1)``, as the pipelines compute it."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def latents_to_vae(latents: torch.Tensor, scaling_factor, shift_factor=None) -> torch.Tensor:
    """The denoiser's latents -> what the VAE decoder takes: ``latents / scaling + shift``.

    SD3 and FLUX pass the VAE config's floats (``shift_factor`` None = 0). VAEs normalised per
    channel (Wan, Qwen-Image: ``latents_mean`` / ``latents_std``) pass tensors shaped to broadcast
    over the latent: ``scaling = 1 / std``, ``shift = mean``, as their pipelines compute it.
    """
    shifted = latents / scaling_factor
    return shifted if shift_factor is None else shifted + shift_factor


def vae_to_latents(encoded: torch.Tensor, scaling_factor, shift_factor=None) -> torch.Tensor:
    """Inverse of `latents_to_vae`: a VAE encoding -> the denoiser's latents, ``(z - shift) * scaling``."""
    return (encoded if shift_factor is None else encoded - shift_factor) * scaling_factor


def to_unit_images(decoded: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] -> float32 images in [0, 1], as ``VaeImageProcessor.postprocess`` maps them."""
    return (decoded.float() / 2 + 0.5).clamp(0.0, 1.0)


def valid_tokens_first(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each row so its valid tokens come first (in order), cut to the longest row.

    A text encoder then sees each prompt from position 0 with padding after it, whatever side the
    ids were padded on, and no column that is padding in every row (the engine pads ids to
    ``max_sequence_length``; the pipelines pad to the longest prompt). ``[B, L]`` -> ``[B, l]``.
    """
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)  # valid positions first
    length = int(mask.sum(1).max())
    return ids.gather(1, order)[:, :length], mask.gather(1, order)[:, :length]

"""`TinyFlowModel`: the embedded shapes model behind the `FlowModel` interface.

Pixel space (no VAE): the latent is the image scaled to [-1, 1]. The folder layout is
diffusers' (``model_index.json``, ``transformer/``, ``text_encoder/``, ``tokenizer/``), loaded
with the same helpers as real pipelines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowloop.models.loading import load_component, load_tokenizer, read_model_index
from flowloop.models.tiny.denoiser import TinyDiT
from flowloop.models.tiny.text_encoder import TinyTextEncoder
from flowloop.models.prompt_ids import unknown_words
from flowloop.models.tiny.tokenizer import save_tokenizer

PIPELINE_CLASS = "FlowloopTinyPipeline"


class TinyFlowModel:
    """Tokenizer + text encoder + pixel-space DiT; see `flowloop.models.base.FlowModel`."""

    def __init__(self, tokenizer, text_encoder: TinyTextEncoder, transformer: TinyDiT):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.transformer = transformer
        self.max_sequence_length = text_encoder.config.max_length
        self.default_resolution = transformer.config.sample_size

    # -- loading and saving -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """Load from a local folder; weights stored in fp16 are cast to ``dtype``."""
        index = read_model_index(path)
        if index.get("_class_name") != PIPELINE_CLASS:
            raise ValueError(f"{path}/model_index.json names {index.get('_class_name')!r}, not {PIPELINE_CLASS!r}")
        tokenizer = load_tokenizer(path, "tokenizer")
        text_encoder = load_component(path, "text_encoder", TinyTextEncoder, dtype).to(device)
        transformer = load_component(path, "transformer", TinyDiT, dtype).to(device)
        return cls(tokenizer, text_encoder, transformer)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """Write the folder; fp16 by default, which halves the shipped size at no visible cost."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, module in (("text_encoder", self.text_encoder), ("transformer", self.transformer)):
            (path / name).mkdir(exist_ok=True)
            module.save_config(str(path / name))
            weights = {key: value.detach().to("cpu", dtype).contiguous() for key, value in module.state_dict().items()}
            save_file(weights, str(path / name / "diffusion_pytorch_model.safetensors"))
        save_tokenizer(self.tokenizer, path / "tokenizer")
        index = {
            "_class_name": PIPELINE_CLASS,
            "_diffusers_version": __import__("diffusers").__version__,
            "text_encoder": ["flowloop.models.tiny", "TinyTextEncoder"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            "transformer": ["flowloop.models.tiny", "TinyDiT"],
        }
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    # -- FlowModel ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is not None:
            raise ValueError("num_frames: the tiny model makes images, not video; leave num_frames unset")
        self.transformer.check_resolution(height, width)
        return (self.transformer.config.in_channels, height, width)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> chat-templated ids and mask ``[B, max_sequence_length]`` (right-padded)."""
        texts = []
        for prompt in prompts:
            unknown = unknown_words(self.tokenizer, prompt)
            if unknown:
                raise ValueError(f"prompt {prompt!r} has words the model does not know: {unknown}")
            texts.append(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False))
        enc = self.tokenizer(texts, add_special_tokens=False, padding="max_length", max_length=self.max_sequence_length, return_tensors="pt")
        if enc.input_ids.shape[1] > self.max_sequence_length:
            lengths = enc.attention_mask.sum(1)
            row = int(torch.argmax(lengths))
            raise ValueError(
                f"prompt {prompts[row]!r} has {int(lengths[row])} tokens, more than max_sequence_length={self.max_sequence_length}"
            )
        return enc.input_ids, enc.attention_mask

    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            embeds = self.text_encoder(prompt_ids.to(self.device), attention_mask.to(self.device))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": attention_mask.to(self.device)}

    def velocity(self, latents, sigma, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """The DiT in the weights' dtype (``model.dtype``); the velocity comes back in the latents'
        dtype, so the step and log-prob math stays float32 under bf16 weights, as in the diffusers
        adapters."""
        dtype = self.transformer.dtype
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        out = self.transformer(latents.to(dtype), sigma, embeds["prompt_embeds"].to(dtype), embeds["prompt_embeds_mask"])
        return out.to(latents.dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> latents in [-1, 1] (pretraining's x0)."""
        return images * 2.0 - 1.0

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

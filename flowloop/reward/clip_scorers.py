"""CLIP-family rewards: CLIP score, PickScore and the LAION aesthetic predictor.

All three embed images with a transformers `CLIPModel` loaded from a LOCAL folder (nothing is
downloaded): the folder holds the model (``config.json``, weights), its tokenizer and its image
processor config, as ``CLIPModel.save_pretrained`` plus ``CLIPProcessor.save_pretrained`` write
them (``preprocessor_config.json``, or ``processor_config.json`` from transformers 5). Images are resized, cropped and normalized with torch ops, so a batch never leaves the
device for PIL.

- ``clip_score``: ``100 * max(cosine(image, text), 0)``, the usual CLIP score (torchmetrics).
- ``pickscore``: ``logit_scale.exp() * cosine(image, text)`` with a PickScore checkpoint, as
  PickScore is used (about 18-24 for real images; Flow-GRPO divides it by 26).
- ``aesthetic``: the improved-aesthetic-predictor MLP on the L2-normalized CLIP image embedding
  (about 1-10). Its head lives in the CLIP folder as ``aesthetic_mlp.safetensors``; convert the
  public ``sac+logos+ava1-l14-linearMSE.pth`` with
  ``safetensors.torch.save_file(torch.load(pth), folder / "aesthetic_mlp.safetensors")``.

Each is a reward factory (``make_clip_score(model_path, device, dtype)``, registered as
``clip_score``; likewise ``pickscore`` and ``aesthetic``) returning the batched function. The
folder is the ``model_path`` kwarg or, when that is unset, an environment variable
(``FLOWLOOP_CLIP_PATH``, ``FLOWLOOP_PICKSCORE_PATH``, ``FLOWLOOP_AESTHETIC_PATH``):

    rollout.reward.name=pickscore rollout.reward.kwargs.model_path=/models/pickscore \
        rollout.reward.kwargs.device=cuda:0

Loaded models are cached per (folder, device, dtype), so workers in one process share them.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from flowloop.reward.registry import register_reward

CLIP_PATH_ENV = "FLOWLOOP_CLIP_PATH"
PICKSCORE_PATH_ENV = "FLOWLOOP_PICKSCORE_PATH"
AESTHETIC_PATH_ENV = "FLOWLOOP_AESTHETIC_PATH"
AESTHETIC_HEAD_FILE = "aesthetic_mlp.safetensors"
"""The aesthetic MLP's weights, inside the CLIP folder; keys as in the public checkpoint."""


class LoadedClip(NamedTuple):
    """A CLIP model with what it needs to read a batch: tokenizer and image preprocessing."""

    model: Any  # transformers.CLIPModel, eval mode, on its device
    tokenizer: Any
    max_length: int
    size: dict | int | None  # the processor's "size": {"shortest_edge": s} or {"height": h, "width": w}
    crop: tuple[int, int] | None  # center crop (height, width), or None
    mean: torch.Tensor  # [3, 1, 1] on the model's device
    std: torch.Tensor  # [3, 1, 1]
    lock: threading.Lock  # a fast tokenizer must not be used from two threads at once


# -- factories ---------------------------------------------------------------------------------
@register_reward("clip_score", factory=True)
def make_clip_score(model_path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype | str = torch.float32):
    """A reward function scoring ``100 * max(cosine, 0)``; extra info: the raw ``cosine``.
    ``model_path`` defaults to ``$FLOWLOOP_CLIP_PATH``."""
    clip = load_clip(_folder(model_path, CLIP_PATH_ENV), device, dtype)

    def clip_score(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        cosine = _cosine(clip, images, prompts)  # [B]
        return (100 * cosine.clamp(min=0)).tolist(), [{"cosine": value} for value in cosine.tolist()]

    return clip_score


@register_reward("pickscore", factory=True)
def make_pickscore(model_path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype | str = torch.float32):
    """A reward function scoring ``logit_scale.exp() * cosine``; extra info: the raw ``cosine``.
    ``model_path`` defaults to ``$FLOWLOOP_PICKSCORE_PATH``."""
    clip = load_clip(_folder(model_path, PICKSCORE_PATH_ENV), device, dtype)
    scale = clip.model.logit_scale.detach().float().exp().cpu()

    def pickscore(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        cosine = _cosine(clip, images, prompts)  # [B]
        return (scale * cosine).tolist(), [{"cosine": value} for value in cosine.tolist()]

    return pickscore


@register_reward("aesthetic", factory=True)
def make_aesthetic(model_path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype | str = torch.float32):
    """A reward function scoring the LAION aesthetic MLP on the CLIP image embedding (prompts
    unused; no extra info). ``model_path`` defaults to ``$FLOWLOOP_AESTHETIC_PATH``."""
    folder = _folder(model_path, AESTHETIC_PATH_ENV)
    clip = load_clip(folder, device, dtype)
    head = load_aesthetic_head(folder, device)

    def aesthetic(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        _check_batch(images, prompts)
        with torch.inference_mode():
            embeds = image_embeddings(clip, images).float()  # [B, D], unit norm
            scores = head(embeds).squeeze(-1).cpu()  # [B]
        return scores.tolist(), [{} for _ in range(len(scores))]

    return aesthetic


def aesthetic_head(width: int) -> torch.nn.Sequential:
    """The improved-aesthetic-predictor MLP (no activations, as published); ``width`` is the CLIP
    projection dim (768 for ViT-L/14). Layer indices match the public checkpoint's keys."""
    return torch.nn.Sequential(
        torch.nn.Linear(width, 1024),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1),
    )


# -- loading (cached) --------------------------------------------------------------------------
_LOAD_LOCK = threading.Lock()


def load_clip(model_path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> LoadedClip:
    """The CLIP model, tokenizer and preprocessing of a local folder; loaded once per
    (folder, device, dtype) and shared by every reward function that asks for it."""
    with _LOAD_LOCK:  # concurrent first calls wait for one load instead of each loading
        return _load_clip(_existing_folder(model_path), str(torch.device(device)), _dtype(dtype))


@functools.lru_cache(maxsize=8)
def _load_clip(folder: str, device: str, dtype: torch.dtype) -> LoadedClip:
    from transformers import AutoTokenizer, CLIPModel

    processor = _image_processor_config(Path(folder))
    model = CLIPModel.from_pretrained(folder).to(device=device, dtype=dtype).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    max_length = min(tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
    crop = _hw(processor["crop_size"]) if processor.get("do_center_crop", False) else None
    if processor.get("do_normalize", True):
        mean, std = processor["image_mean"], processor["image_std"]
    else:
        mean, std = [0.0] * 3, [1.0] * 3
    size = processor["size"] if processor.get("do_resize", True) else None
    return LoadedClip(
        model=model,
        tokenizer=tokenizer,
        max_length=max_length,
        size=size,
        crop=crop,
        mean=torch.tensor(mean, device=device).view(3, 1, 1),
        std=torch.tensor(std, device=device).view(3, 1, 1),
        lock=threading.Lock(),
    )


def _image_processor_config(folder: Path) -> dict:
    """The image processor's settings: ``preprocessor_config.json``, or the ``image_processor``
    entry of ``processor_config.json`` (where transformers 5 saves a whole CLIPProcessor)."""
    if (folder / "preprocessor_config.json").is_file():
        return json.loads((folder / "preprocessor_config.json").read_text())
    if (folder / "processor_config.json").is_file():
        config = json.loads((folder / "processor_config.json").read_text())
        if "image_processor" in config:
            return config["image_processor"]
    raise FileNotFoundError(f"no image processor config (preprocessor_config.json) in {folder}: save the model's CLIPProcessor there")


def load_aesthetic_head(model_path: str | os.PathLike, device: str | torch.device = "cpu") -> torch.nn.Sequential:
    """The aesthetic MLP from ``<model_path>/aesthetic_mlp.safetensors`` (float32, eval mode)."""
    with _LOAD_LOCK:
        return _load_aesthetic_head(_existing_folder(model_path), str(torch.device(device)))


@functools.lru_cache(maxsize=8)
def _load_aesthetic_head(folder: str, device: str) -> torch.nn.Sequential:
    from safetensors.torch import load_file

    path = Path(folder) / AESTHETIC_HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the aesthetic reward needs its MLP head at {path}, which does not exist")
    state = {key.removeprefix("layers."): value for key, value in load_file(str(path)).items()}  # public keys: layers.N.*
    if "0.weight" not in state:
        raise ValueError(f"{path} is not an aesthetic MLP head: no 'layers.0.weight' among {sorted(state)[:8]}")
    head = aesthetic_head(state["0.weight"].shape[1])
    head.load_state_dict(state)
    return head.to(device).eval().requires_grad_(False)


# -- embedding ---------------------------------------------------------------------------------
def image_embeddings(clip: LoadedClip, images: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` in [0, 1] -> unit-norm CLIP image embeddings ``[B, D]``."""
    pixels = preprocess(clip, images)  # [B, 3, h, w]
    pooled = clip.model.vision_model(pixel_values=pixels).pooler_output  # [B, hidden]
    embeds = clip.model.visual_projection(pooled)  # [B, D]
    return embeds / embeds.norm(dim=-1, keepdim=True)


def text_embeddings(clip: LoadedClip, prompts: list[str]) -> torch.Tensor:
    """Prompts -> unit-norm CLIP text embeddings ``[B, D]`` (truncated to the model's length)."""
    with clip.lock:
        tokens = clip.tokenizer(list(prompts), padding=True, truncation=True, max_length=clip.max_length, return_tensors="pt")
    device = clip.mean.device
    out = clip.model.text_model(input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device))
    embeds = clip.model.text_projection(out.pooler_output)  # [B, D]
    return embeds / embeds.norm(dim=-1, keepdim=True)


def preprocess(clip: LoadedClip, images: torch.Tensor) -> torch.Tensor:
    """The processor's resize (bicubic, antialiased), center crop and normalization, in torch."""
    x = images.to(clip.mean.device, torch.float32)  # bicubic needs float32 on CPU
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)  # grayscale -> RGB, as the processor's convert_rgb
    if clip.size is not None:
        x = F.interpolate(x, size=_resize_to(x.shape[-2:], clip.size), mode="bicubic", antialias=True, align_corners=False)
        x = x.clamp(0, 1)  # bicubic overshoots; the processor resizes 8-bit images
    if clip.crop is not None:
        (height, width), (crop_h, crop_w) = x.shape[-2:], clip.crop
        top, left = max(0, (height - crop_h) // 2), max(0, (width - crop_w) // 2)
        x = x[..., top : top + crop_h, left : left + crop_w]
    x = (x - clip.mean) / clip.std
    return x.to(clip.model.dtype)


def _cosine(clip: LoadedClip, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    _check_batch(images, prompts)
    with torch.inference_mode():
        similarity = (image_embeddings(clip, images) * text_embeddings(clip, prompts)).sum(dim=-1)  # [B]
    return similarity.float().cpu()


def _check_batch(images: torch.Tensor, prompts: list[str]) -> None:
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"CLIP rewards score images [B, 3, H, W] (or 1 channel), got shape {tuple(images.shape)}; "
            "wrap the reward with flowloop.reward.video.per_frame for videos [B, T, C, H, W]"
        )
    if images.shape[0] != len(prompts):
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")


def _resize_to(hw, size: dict | int) -> tuple[int, int]:
    """The processor's output size: shortest edge scaled to ``size`` (aspect kept), or exact h, w."""
    height, width = int(hw[0]), int(hw[1])
    if isinstance(size, int):
        size = {"shortest_edge": size}
    if "shortest_edge" in size:
        short, long = sorted((height, width))
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)
    return size["height"], size["width"]


def _hw(size: dict | int) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (size["height"], size["width"])


# -- arguments ---------------------------------------------------------------------------------
def _folder(model_path: str | os.PathLike | None, env: str) -> str:
    """``model_path``, else the environment variable ``env``: an existing folder, or an error
    naming where the path came from."""
    if model_path:
        return _existing_folder(model_path, "model_path")
    if not os.environ.get(env):
        raise ValueError(f"no model folder: pass model_path or set the environment variable {env} to a local CLIP folder")
    return _existing_folder(os.environ[env], f"${env}")


def _existing_folder(model_path: str | os.PathLike, source: str = "model_path") -> str:
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {str(folder)!r} (from {source}) does not exist; weights are never downloaded, save them there first"
        )
    return str(folder.resolve())


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return value

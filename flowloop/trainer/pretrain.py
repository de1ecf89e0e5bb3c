"""Pretraining the embedded shapes model from scratch with rectified flow.

``x_t = (1 - t) x0 + t eps``, the denoiser regresses the velocity ``eps - x0``; ``t`` is drawn
logit-normal as SD3 does, and 10% of captions are dropped so classifier-free guidance works.
Only train-split scenes are ever rendered (`sample_scene(split="train")`): train prompts, and
colours the train split allows where a prompt leaves them free, so no held-out colour-shape or
shape-shape composition is ever seen, which is what makes held-out accuracy a test of
composition. Runs on a CPU (slowly) or a GPU (minutes).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from flowloop.models.tiny import TinyDiT, TinyFlowModel, TinyTextEncoder, build_tokenizer
from flowloop.tasks import shapes
from flowloop.trainer.evaluate import evaluate


@dataclass
class PretrainConfig:
    out: str = "runs/pretrain"
    """Folder for the final model, ``checkpoints/step_N/`` folders and ``pretrain_log.jsonl``."""
    resolution: int = 32
    """Training image size; 32 keeps CPU RL fast (64 image tokens, against 144 at 48) while the
    verifier still reads all six shapes (docs/shapes-world.md)."""
    steps: int = 20000
    """Optimizer steps. Accuracy stays near zero for the first few thousand."""
    batch_size: int = 256
    """Scenes per optimizer step."""
    lr: float = 3e-4
    """AdamW learning rate after warm-up (constant: runs are cut by steps or time)."""
    warmup_steps: int = 500
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay; the EMA already smooths the saved weights."""
    ema_decay: float = 0.999
    """EMA of the weights is what gets evaluated and saved: it samples much cleaner images."""
    caption_dropout: float = 0.1
    """Share of captions replaced by the empty prompt, so guidance_scale > 1 can be used."""
    dataset_size: int = 200_000
    """Scenes rendered once up front (train prompts only) and sampled with replacement."""
    render_workers: int = 0
    """Processes for rendering the dataset; 0 means one per CPU core."""
    eval_every: int = 2500
    """Evaluate the EMA weights on held-out prompts (and save a checkpoint) every k steps."""
    eval_samples_per_prompt: int = 4
    """Seeds per held-out prompt in those evaluations."""
    eval_num_steps: int = 40
    """ODE steps for the held-out check; 40 matches `flowloop eval`."""
    time_budget_min: float = 0.0
    """Stop early (then evaluate and save) once training has run this long; 0 means no limit."""
    init: str | None = None
    """Start from this model folder instead of random weights (to continue a run, or to carry a model
    over to a world with more words: see `initial_model`)."""
    seed: int = 0
    """Seeds the dataset, the initial weights and the training noise."""
    device: str = "auto"
    """``auto`` takes CUDA when present, else the CPU."""
    bf16: bool = True
    """bf16 autocast on CUDA (ignored on CPU)."""
    hidden_size: int = 160
    """DiT width; 160 x 6 blocks (3.0M parameters) samples 128 images in ~3 s on a 2-core CPU."""
    depth: int = 6
    """DiT blocks."""
    num_heads: int = 5
    """Attention heads (head size 32)."""
    patch_size: int = 4
    """Pixels per patch side: 64 image tokens at 32x32."""
    text_hidden_size: int = 128
    """Text encoder width (and the DiT's text input size)."""
    text_depth: int = 2
    """Text encoder blocks."""
    max_sequence_length: int = 16
    """Prompt tokens, chat-template start token included (sampled prompts have at most 9)."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "dataset_size", "eval_every", "resolution"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"caption_dropout={self.caption_dropout} must be in [0, 1)")


def _render_chunk(args: tuple[int, int, int]) -> tuple[np.ndarray, list[str]]:
    seed, count, resolution = args
    rng = np.random.default_rng(seed)
    images, prompts = [], []
    for _ in range(count):
        scene = shapes.sample_scene(rng, split="train")
        images.append(shapes.render(scene, size=resolution))
        prompts.append(shapes.prompt_for(scene))
    return np.stack(images), prompts


def render_dataset(size: int, resolution: int, seed: int, workers: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Render ``size`` train-split scenes in parallel; deterministic for a given seed and size."""
    chunk = 2000
    jobs = [(seed * 1_000_003 + i, min(chunk, size - i * chunk), resolution) for i in range(math.ceil(size / chunk))]
    workers = workers or (torch.multiprocessing.cpu_count() or 1)
    if workers == 1:
        parts = list(map(_render_chunk, jobs))
    else:
        with get_context("spawn").Pool(workers) as pool:
            parts = pool.map(_render_chunk, jobs)
    images = torch.from_numpy(np.concatenate([p[0] for p in parts])).permute(0, 3, 1, 2).contiguous()  # [N, 3, H, W] uint8
    return images, [prompt for p in parts for prompt in p[1]]


def build_model(cfg: PretrainConfig) -> TinyFlowModel:
    tokenizer = build_tokenizer(shapes.VOCABULARY, model_max_length=cfg.max_sequence_length)
    text_encoder = TinyTextEncoder(
        vocab_size=len(tokenizer), max_length=cfg.max_sequence_length, hidden_size=cfg.text_hidden_size,
        depth=cfg.text_depth, num_heads=max(1, cfg.text_hidden_size // 32),
    )
    transformer = TinyDiT(
        sample_size=cfg.resolution, patch_size=cfg.patch_size, hidden_size=cfg.hidden_size, depth=cfg.depth,
        num_heads=cfg.num_heads, text_dim=cfg.text_hidden_size,
    )
    return TinyFlowModel(tokenizer, text_encoder, transformer)


def initial_model(cfg: PretrainConfig) -> TinyFlowModel:
    """Random weights, or ``cfg.init``'s. A model whose tokenizer lacks words of today's vocabulary
    (the world has grown since it was trained) is carried over word by word: every word it knows
    keeps its embedding row, a new word starts from a random one, and every other weight is kept,
    so what it learned about the old words, layout and colours is where training starts."""
    if not cfg.init:
        return build_model(cfg)
    old = TinyFlowModel.from_pretrained(cfg.init)
    old_vocab = old.tokenizer.get_vocab()
    tokenizer = build_tokenizer(shapes.VOCABULARY, model_max_length=old.max_sequence_length)
    vocab = tokenizer.get_vocab()
    if set(vocab) <= set(old_vocab):
        return old
    text_config = {k: old.text_encoder.config[k] for k in ("max_length", "hidden_size", "depth", "num_heads")}
    text_encoder = TinyTextEncoder(vocab_size=len(tokenizer), **text_config)
    state = old.text_encoder.state_dict()
    rows = text_encoder.token_embedding.weight.detach().clone()
    for word, i in vocab.items():
        if word in old_vocab:
            rows[i] = state["token_embedding.weight"][old_vocab[word]]
    state["token_embedding.weight"] = rows
    text_encoder.load_state_dict(state)
    return TinyFlowModel(tokenizer, text_encoder, old.transformer)


def pretrain(cfg: PretrainConfig, log=print) -> Path:
    """Train, evaluate every ``eval_every`` steps, and save; returns the output folder."""
    # 1. Set up device, model, EMA copy and data.
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else ("cpu" if cfg.device == "auto" else cfg.device))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model = initial_model(cfg)
    ema = copy.deepcopy(model)
    modules = torch.nn.ModuleDict({"text_encoder": model.text_encoder, "transformer": model.transformer}).to(device)
    modules.requires_grad_(True).train()
    ema_modules = torch.nn.ModuleDict({"text_encoder": ema.text_encoder, "transformer": ema.transformer}).to(device)
    ema_modules.requires_grad_(False).eval()
    n_params = sum(p.numel() for p in modules.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters on {device}; rendering {cfg.dataset_size} train scenes...")
    t0 = time.time()
    images, prompts = render_dataset(cfg.dataset_size, cfg.resolution, cfg.seed, cfg.render_workers)
    unique_prompts = sorted(set(prompts))
    prompt_index = {p: i for i, p in enumerate(unique_prompts)}
    table_ids, table_mask = model.tokenize(unique_prompts + [""])  # last row: the empty prompt
    table_ids, table_mask = table_ids.to(device), table_mask.to(device)
    prompt_rows = torch.tensor([prompt_index[p] for p in prompts], device=device)
    images = images.to(device)
    log(f"rendered {len(prompts)} scenes of {len(unique_prompts)} prompts in {time.time() - t0:.1f}s")

    # 2. Optimize.
    optimizer = torch.optim.AdamW(modules.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16 and device.type == "cuda")
    log_path = out / "pretrain_log.jsonl"
    t0, running = time.time(), 0.0
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(0, len(prompts), (cfg.batch_size,), device=device, generator=generator)
        x0 = images[idx].float() / 127.5 - 1.0  # [B, 3, H, W]
        rows = prompt_rows[idx]
        drop = torch.rand(cfg.batch_size, device=device, generator=generator) < cfg.caption_dropout
        rows = torch.where(drop, torch.full_like(rows, len(unique_prompts)), rows)
        ids, mask = table_ids[rows], table_mask[rows]
        t = torch.sigmoid(torch.randn(cfg.batch_size, device=device, generator=generator))  # logit-normal
        eps = torch.randn(x0.shape, device=device, generator=generator)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        with autocast:
            text = modules["text_encoder"](ids, mask)
            v = modules["transformer"](xt, t, text, mask)
        loss = torch.nn.functional.mse_loss(v.float(), eps - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for p_ema, p in zip(ema_modules.parameters(), modules.parameters()):
                p_ema.lerp_(p, 1.0 - cfg.ema_decay)
        running = 0.98 * running + 0.02 * loss.item() if step > 1 else loss.item()
        if step % 100 == 0:
            log(f"step {step}/{cfg.steps} loss {running:.4f} {(time.time() - t0) / step * 1000:.0f} ms/step")
        out_of_time = cfg.time_budget_min > 0 and time.time() - t0 > 60 * cfg.time_budget_min
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            # 3. Evaluate the EMA weights on held-out prompts and keep a checkpoint.
            result, _, _ = evaluate(ema, "heldout", cfg.eval_samples_per_prompt, cfg.eval_num_steps, batch_size=256)
            record = {"step": step, "loss": running, "elapsed_s": time.time() - t0, **result.as_dict()}
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            log(f"eval step {step}: held-out accuracy {result.accuracy:.3f} score {result.score:.3f} "
                + " ".join(f"{k}={v['accuracy']:.2f}" for k, v in result.per_category.items()))
            ema.save_pretrained(out / "checkpoints" / f"step_{step}")
        if out_of_time:
            log(f"time budget of {cfg.time_budget_min} min reached at step {step}")
            break
    ema.save_pretrained(out / "model")
    (out / "pretrain_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return out

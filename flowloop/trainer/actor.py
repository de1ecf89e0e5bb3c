"""The FlowGRPO actor: replay stored trajectories, clipped policy-gradient loss, optional KL.

For each micro-batch and each trained step of the SDE window, the actor recomputes the velocity
at the stored latent with the current weights, re-runs the same sampler step with
``prev_sample`` = the stored next latent, and gets that step's log-prob and mean. The velocity
comes from `flowloop.rollout.engine.guided_velocity`, the function the rollout sampled with,
so with unchanged weights the replay reproduces the rollout's log-prob (the rollout-correction
metric measures how closely).

With ``actor.objective=nft`` the same loop trains DiffusionNFT instead: each "trained step" is a
noise level drawn per row, where the current and the sampling weights' velocities at the
re-noised clean sample enter `flowloop.trainer.losses.nft_loss`.
"""

from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager, nullcontext

import torch

from flowloop.config.train import ActorConfig
from flowloop.models.base import is_embedding_key
from flowloop.protocol import Batch
from flowloop.rollout.engine import guided_velocity
from flowloop.rollout.types import SamplingParams
from flowloop.sampling import get_step
from flowloop.trainer.lora import adapters_disabled, add_lora
from flowloop.trainer.losses import flow_grpo_loss, kl_loss, nft_loss, noised

logger = logging.getLogger(__name__)


class Actor:
    """Owns the trainable denoiser's optimizer and the frozen reference; `update` is one RL update."""

    def __init__(self, model, config: ActorConfig, sampling: SamplingParams, seed: int = 0,
                 total_optimizer_steps: int | None = None):
        """``total_optimizer_steps``: the run's planned optimizer steps, which a decaying
        ``config.lr_schedule`` needs (`optimizer_steps_per_batch` x RL steps)."""
        self.model = model
        self.config = config
        self.sampling = sampling
        self.step_fn = get_step(sampling.sampler)
        self.step_kwargs = {"logprob_mode": sampling.logprob_mode} if sampling.sampler == "cps" else {}
        self.module = model.trainable_module()
        self.reference = None
        if config.finetune == "lora":
            add_lora(self.module, config)
        elif config.kl_coef > 0:
            self.reference = copy.copy(model)
            self.reference.transformer = copy.deepcopy(self.module).requires_grad_(False).eval()
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        low_precision = sorted({str(p.dtype) for p in trainable if p.dtype != torch.float32})
        if low_precision:
            logger.warning("training %s weights with AdamW: steps below their resolution round away; use "
                           "actor.finetune=lora (float32 adapters) or model.dtype=float32", "/".join(low_precision))
        self.ema = None
        if config.ema_decay is not None:
            self.ema = {name: p.detach().clone() for name, p in self.module.named_parameters() if p.requires_grad}
        torch.manual_seed(seed)
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config, total_optimizer_steps))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint must hold (all of them, or the LoRA adapters)."""
        return {k: v for k, v in self.module.state_dict().items() if self.config.finetune == "full" or "lora_" in k}

    @contextmanager
    def ema_weights(self):
        """Inside the block the module holds the EMA weights (no-op without EMA)."""
        if self.ema is None:
            yield
            return
        params = dict(self.module.named_parameters())
        live = {name: params[name].detach().clone() for name in self.ema}
        with torch.no_grad():
            for name, value in self.ema.items():
                params[name].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in live.items():
                    params[name].copy_(value)

    # -- replay -------------------------------------------------------------------------
    def velocity(self, rows: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor,
                 reference: bool = False) -> torch.Tensor:
        """The (guided) velocity at ``x [b, ...]``, ``t [b]`` for ``rows``' prompts, with the
        current weights or the frozen reference's."""
        embeds = {k: v for k, v in rows.items() if is_embedding_key(k)}
        if reference and self.reference is not None:
            model, context = self.reference, nullcontext()
        elif reference:  # LoRA: the base model is the adapters switched off
            model, context = self.model, adapters_disabled(self.module)
        else:
            model, context = self.model, nullcontext()
        with context:
            return guided_velocity(model, x, t, embeds, self.sampling.guidance_scale)

    def replay(self, rows: dict[str, torch.Tensor], j: int, reference: bool = False):
        """Re-run step ``j`` of the window for ``rows``; returns the sampler's `StepOutput`."""
        x = rows["all_latents"][:, j]  # [b, C, H, W]
        t, t_next = rows["all_timesteps"][:, j], rows["all_next_timesteps"][:, j]  # [b]
        v = self.velocity(rows, x, t, reference)
        return self.step_fn(v, t, t_next, x, noise_level=self.sampling.noise_level,
                            prev_sample=rows["all_latents"][:, j + 1], **self.step_kwargs)

    # -- update -------------------------------------------------------------------------
    def update(self, batch: Batch, advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """One RL update on ``batch`` (rows with ``all_latents`` etc.), ``advantages`` ``[B]``."""
        cfg = self.config
        device = next(self.module.parameters()).device
        nft = cfg.objective == "nft"
        micro_per_mini = cfg.mini_batch_size // cfg.micro_batch_size
        embed_keys = [k for k in batch.keys() if is_embedding_key(k)]
        advantages = advantages.to(device)
        self.module.eval()  # no dropout: replay must see the function the rollout sampled
        if nft:
            tensors = {k: batch[k].to(device) for k in ["final_latents", *embed_keys]}
            tensors.update(self._nft_draws(tensors, generator))
            trained = cfg.nft_timesteps
        else:
            keys = ["all_latents", "all_timesteps", "all_next_timesteps", "rollout_log_probs", *embed_keys]
            tensors = {k: batch[k].to(device) for k in keys}
            trained = max(1, math.ceil(cfg.timestep_fraction * tensors["rollout_log_probs"].shape[1]))
        orders = [torch.randperm(len(batch), generator=generator).to(device) for _ in range(cfg.inner_epochs)]
        old = None  # the sampling weights' velocity (NFT) or log-prob (FlowGRPO's old-log-prob pass)
        if nft or not cfg.skip_old_logprob:
            old = self._sampling_weights_pass(tensors, orders[0][cfg.mini_batch_size:], trained, nft)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        correction: list[torch.Tensor] = []
        grad_norms = []
        for order in orders:
            micro_batches = order.split(cfg.micro_batch_size)
            for m, rows_idx in enumerate(micro_batches):
                rows = {k: v[rows_idx] for k, v in tensors.items()}
                adv = advantages[rows_idx]
                fresh = not grad_norms  # no optimizer step yet: the weights are those of the rollout
                for j in range(trained):
                    if nft:
                        loss, diag, kl = self._nft_term(rows, adv, j, _old_values(old, rows_idx, j, fresh))
                    else:
                        loss, diag, kl = self._flow_grpo_term(rows, adv, j, _old_values(old, rows_idx, j, fresh),
                                                              correction if fresh else None)
                    if kl is not None:
                        loss = loss + cfg.kl_coef * kl
                        diag = {**diag, "kl_loss": kl.detach()}
                    (loss / (trained * micro_per_mini)).backward()
                    _accumulate(sums, counts, {"policy_loss": loss.detach(), **diag})
                if (m + 1) % micro_per_mini == 0 or m == len(micro_batches) - 1:
                    grad_norms.append(self._optimizer_step())
        metrics = {f"actor/{k}": sums[k] / counts[k] for k in sums}
        metrics["actor/grad_norm"] = float(torch.stack(grad_norms).mean())
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/optimizer_steps"] = len(grad_norms)
        if correction:  # FlowGRPO only: DiffusionNFT replays no log-probs
            all_correction = torch.cat(correction)
            metrics["rollout_correction/mean"] = float(all_correction.mean())
            metrics["rollout_correction/max"] = float(all_correction.max())
        return metrics

    def _flow_grpo_term(self, rows: dict[str, torch.Tensor], adv: torch.Tensor, j: int, old_values,
                        correction: list[torch.Tensor] | None):
        """FlowGRPO's loss, its diagnostics and the transition KL to the reference (None without
        a KL term) at window step ``j``; appends ``|logp_replay - logp_rollout|`` to ``correction``
        when given. ``old_values`` (`_old_values`) gives logp_old; None: the rollout's own."""
        cfg = self.config
        out = self.replay(rows, j)
        if correction is not None:
            correction.append((out.log_prob.detach() - rows["rollout_log_probs"][:, j]).abs())
        old = rows["rollout_log_probs"][:, j] if old_values is None else old_values(out.log_prob)
        loss, diag = flow_grpo_loss(out.log_prob, old, adv, cfg.clip_range, cfg.adv_clip_max)
        if cfg.kl_coef == 0:
            return loss, diag, None
        with torch.no_grad():
            ref = self.replay(rows, j, reference=True)
        dt = rows["all_next_timesteps"][:, j] - rows["all_timesteps"][:, j]
        kl = kl_loss(out.mean, ref.mean, out.std, dt=dt if self.sampling.sampler == "sde" else None, mode=cfg.kl_mode)
        return loss, diag, kl.mean()

    # -- DiffusionNFT -------------------------------------------------------------------
    @torch.no_grad()
    def _nft_draws(self, tensors: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Per row and trained term: a noise level ``nft_t [B, K]`` and the noised clean sample
        ``nft_noisy [B, K, ...]``."""
        cfg = self.config
        sample = tensors["final_latents"]  # [B, ...]
        rows, k = sample.shape[0], cfg.nft_timesteps
        lo, hi = cfg.nft_time_range
        t = (lo + (hi - lo) * torch.rand((rows, k), generator=generator)).to(sample.device)  # [B, K]
        noise = torch.randn((rows, k, *sample.shape[1:]), generator=generator).to(sample.device)  # [B, K, ...]
        noisy = torch.stack([noised(sample, noise[:, j], t[:, j]) for j in range(k)], dim=1)  # [B, K, ...]
        return {"nft_t": t, "nft_noisy": noisy}

    def _nft_term(self, rows: dict[str, torch.Tensor], adv: torch.Tensor, j: int, old_values):
        """DiffusionNFT's loss, its diagnostics and the velocity KL to the reference (None without
        a KL term) at the rows' ``j``-th noise level; ``old_values`` (`_old_values`) gives the
        sampling weights' velocity."""
        cfg = self.config
        x, t = rows["nft_noisy"][:, j], rows["nft_t"][:, j]
        v = self.velocity(rows, x, t).float()
        loss, diag = nft_loss(v, old_values(v), rows["final_latents"], x, t, adv, cfg.nft_beta, cfg.adv_clip_max)
        if cfg.kl_coef == 0:
            return loss, diag, None
        with torch.no_grad():
            v_ref = self.velocity(rows, x, t, reference=True).float()
        return loss, diag, kl_loss(v, v_ref, 1.0, mode="exact").mean()  # mean (v - v_ref)^2 / 2

    def _optimizer_step(self) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if torch.isfinite(norm):
            self.optimizer.step()
            if self.ema is not None:
                with torch.no_grad():
                    for name, p in self.module.named_parameters():
                        if name in self.ema:
                            self.ema[name].lerp_(p, 1.0 - self.config.ema_decay)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach().cpu()

    @torch.no_grad()
    def _sampling_weights_pass(self, tensors: dict[str, torch.Tensor], rows: torch.Tensor, trained: int,
                               nft: bool) -> torch.Tensor:
        """What the loss compares against, computed with the weights that sampled, before any
        optimizer step of this update: the velocity at every ``nft_noisy`` (NFT, ``[B, K, ...]``)
        or the replayed log-prob of every trained window step (FlowGRPO, ``[B, T]``), for ``rows``
        only (NaN elsewhere).

        Why only some rows: the rows trained before the first optimizer step see those weights in
        their own training forward, which `_old_values` detaches and stores instead of running a
        second, no-grad forward. With ``mini_batch_size`` >= the batch (one optimizer step per
        update) this pass runs on no row at all."""
        out = torch.full_like(tensors["nft_noisy" if nft else "rollout_log_probs"], math.nan)
        for idx in rows.split(self.config.micro_batch_size) if len(rows) else ():
            part = {key: value[idx] for key, value in tensors.items()}
            for j in range(trained):
                out[idx, j] = (self.velocity(part, part["nft_noisy"][:, j], part["nft_t"][:, j]).float() if nft
                               else self.replay(part, j).log_prob)
        return out


def _old_values(store: torch.Tensor | None, rows_idx: torch.Tensor, j: int, fresh: bool):
    """A function of the rows' current value (velocity or log-prob) at term ``j`` that returns the
    sampling weights' value: while no optimizer step has been made (``fresh``) that is the current
    value itself, detached, and it is stored for later epochs; afterwards, the stored one. None
    when there is no store (FlowGRPO with ``skip_old_logprob``)."""
    if store is None:
        return None

    def values(current: torch.Tensor) -> torch.Tensor:
        if fresh:
            store[rows_idx, j] = current.detach()
        return store[rows_idx, j]

    return values


def lr_factor(config: ActorConfig, total_steps: int | None):
    """The scheduler's multiplier of ``config.lr`` at optimizer step ``s`` (0-based): linear
    warm-up over ``warmup_steps``, then ``lr_schedule`` down to ``lr_final_ratio`` at ``total_steps``."""
    if config.lr_schedule != "constant" and total_steps is None:
        raise ValueError(f"actor.lr_schedule={config.lr_schedule!r} needs the run's planned optimizer steps")
    warmup = max(config.warmup_steps, 1)
    if config.lr_schedule != "constant" and config.warmup_steps >= total_steps:
        raise ValueError(f"actor.warmup_steps={config.warmup_steps} leaves no room for the {config.lr_schedule} decay: "
                         f"the run plans {total_steps} optimizer steps; lower actor.warmup_steps")
    floor = config.lr_final_ratio

    def factor(s: int) -> float:
        if s + 1 < warmup:
            return (s + 1) / warmup
        if config.lr_schedule == "constant":
            return 1.0
        done = min(1.0, (s + 1 - warmup) / max(total_steps - warmup, 1))
        decay = 1.0 - done if config.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return floor + (1.0 - floor) * decay

    return factor


def optimizer_steps_per_batch(config: ActorConfig, rows: int) -> int:
    """How many optimizer steps `Actor.update` makes on a batch of ``rows``."""
    micro = math.ceil(rows / config.micro_batch_size)
    return math.ceil(micro / (config.mini_batch_size // config.micro_batch_size)) * config.inner_epochs


def _accumulate(sums: dict, counts: dict, values: dict) -> None:
    for key, value in values.items():
        sums[key] = sums.get(key, 0.0) + float(value)
        counts[key] = counts.get(key, 0) + 1

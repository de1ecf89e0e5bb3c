"""Schema of ``actor``: the policy update (optimizer, LoRA, KL) and each objective's own section.

``actor.objective`` names a registered objective (`flowloop.trainer.objectives`); the settings
only that objective reads sit in its own section (``actor.flow_grpo``, ``actor.nft``), the ones
every objective shares (learning rate, batch sizes, advantage clamp, KL weight) at the top.
`ActorConfig.validate` checks every value here with its full key; what an objective needs from the
rollout (log-probs, a noisy sampler) the objective checks itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

KL_MODES = ("flow_grpo", "exact")
FINETUNE_MODES = ("full", "lora")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class FlowGRPOConfig:
    """``actor.flow_grpo``: the clipped policy gradient on the SDE window's replayed log-probs."""

    clip_range: float = 1e-4
    """PPO ratio clip; flow_grpo's published value for per-element-mean log-probs."""
    timestep_fraction: float = 1.0
    """Share of each row's recorded (SDE-window) steps trained on, taken in order."""
    kl_mode: str = "flow_grpo"
    """``flow_grpo`` (squared mean gap over 2 s^2, s without sqrt(-dt)) or ``exact`` (Gaussian KL)."""
    balance_steps: bool = False
    """Multiply each trained step's loss by ``std / |d mean / d v|`` of its transition, scaled to
    mean 1 over the row's trained steps. A step's log-prob gradient with respect to the velocity
    is proportional to ``|d mean / d v| / std``, which is smallest at the high-noise steps; with this
    on, one velocity change moves every trained step's loss by the same amount. Off: the published
    unweighted loss."""
    skip_old_logprob: bool = True
    """Use the rollout's log-probs as logp_old (exact with colocated weights: see the
    rollout-correction metric) instead of a separate no-grad replay with the sampling weights."""

    def validate(self, prefix: str = "actor.flow_grpo") -> None:
        _positive(f"{prefix}.clip_range", self.clip_range)
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"{prefix}.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        _choice(f"{prefix}.kl_mode", self.kl_mode, KL_MODES)


@dataclass
class NFTConfig:
    """``actor.nft``: DiffusionNFT, the flow-matching loss on the rollout's clean samples weighted
    by advantage; it needs no log-probs, so any sampler works, the ODE included."""

    beta: float = 1.0
    """How far the implicit positive/negative policies sit from the old one (smaller = a stronger
    pull per unit of advantage, a wider trust region)."""
    timesteps: int = 2
    """Noise levels drawn per row and update (each one forward and backward, like a window step)."""
    time_range: List[float] = field(default_factory=lambda: [0.0, 1.0])
    """``[lo, hi]``: the noise levels t are drawn uniformly in it (1 = pure noise)."""

    def validate(self, prefix: str = "actor.nft") -> None:
        _positive(f"{prefix}.beta", self.beta)
        if self.timesteps < 1:
            raise ValueError(f"{prefix}.timesteps must be >= 1, got {self.timesteps}")
        bounds = list(self.time_range)
        if len(bounds) != 2 or not 0.0 <= bounds[0] < bounds[1] <= 1.0:
            raise ValueError(f"{prefix}.time_range must be [lo, hi] with 0 <= lo < hi <= 1, got {bounds}")


@dataclass
class ActorConfig:
    objective: str = "flow_grpo"
    """The registered objective the update trains (`flowloop.trainer.objectives`): ``flow_grpo``
    (settings in ``actor.flow_grpo``) or ``nft`` (DiffusionNFT, settings in ``actor.nft``)."""
    flow_grpo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)
    """FlowGRPO's settings, read only with ``objective: flow_grpo``."""
    nft: NFTConfig = field(default_factory=NFTConfig)
    """DiffusionNFT's settings, read only with ``objective: nft``."""
    finetune: str = "full"
    """``full`` trains every denoiser weight; ``lora`` trains peft adapters (extra ``peft``)."""
    lora_rank: int = 16
    """LoRA rank; 16 is plenty for a 3M-parameter denoiser (published SD3.5 recipes use 32)."""
    lora_alpha: int = 16
    """LoRA scale numerator (alpha / rank = 1 keeps the adapters' initial step size neutral)."""
    lora_target_modules: List[str] = field(default_factory=lambda: ["qkv", "proj"])
    """Module name suffixes adapted by LoRA; one that matches nothing is an error."""
    lr: float = 1e-5
    """AdamW learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, or ``linear`` / ``cosine`` decay to ``lr * lr_final_ratio`` at
    the run's last planned optimizer step (trainer.total_steps x the optimizer steps one full
    batch makes; dropped zero-variance groups or a skipped non-finite step make fewer, so such a
    run ends a little above it; changing trainer.total_steps on resume reshapes the remaining
    decay)."""
    lr_final_ratio: float = 0.0
    """The decayed schedules' final lr as a share of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay; 0 because the KL term already keeps the policy near the base."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip per optimizer step. A step whose loss or gradient norm is not finite is
    skipped: no weight, optimizer-state, EMA or schedule change (metric ``actor/skipped_nonfinite``)."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max (``inf``: no clamp, FlowGRPO only)."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen base model; 0 skips the reference pass."""
    micro_batch_size: int = 32
    """Rows per forward/backward pass, over all trainer ranks together: with N ranks each
    device takes about ``micro_batch_size / N`` of them, so one config computes the same update
    on any number of ranks (`flowloop.trainer.sharding`)."""
    mini_batch_size: int = 64
    """Rows per optimizer step (gradients of micro-batches accumulate)."""
    inner_epochs: int = 1
    """Passes over each RL batch."""
    ema_decay: Optional[float] = None
    """EMA of the trained weights, updated after every optimizer step, swapped in for validation
    and kept in checkpoints (``flowloop eval|generate|export --ema`` use it); None = off
    (validation sees the live weights)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad ``actor.*`` key; the objective's own section
        included, whatever the objective (a section's defaults are always valid)."""
        _choice("actor.finetune", self.finetune, FINETUNE_MODES)
        _choice("actor.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        self.flow_grpo.validate()
        self.nft.validate()
        _positive("actor.lr", self.lr)
        for key, value in (("actor.micro_batch_size", self.micro_batch_size),
                           ("actor.mini_batch_size", self.mini_batch_size), ("actor.inner_epochs", self.inner_epochs)):
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"actor.mini_batch_size={self.mini_batch_size} must be a multiple of "
                             f"actor.micro_batch_size={self.micro_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"actor.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.lr_final_ratio <= 1.0:
            raise ValueError(f"actor.lr_final_ratio must be in [0, 1], got {self.lr_final_ratio}")
        if self.lr_final_ratio and self.lr_schedule == "constant":
            raise ValueError(f"actor.lr_final_ratio={self.lr_final_ratio} has no effect with actor.lr_schedule=constant; "
                             "set actor.lr_schedule=linear or cosine")
        _positive("actor.weight_decay", self.weight_decay, allow_zero=True)
        _positive("actor.kl_coef", self.kl_coef, allow_zero=True)
        if not self.max_grad_norm > 0:
            raise ValueError(f"actor.max_grad_norm must be > 0 (inf: no clipping), got {self.max_grad_norm}")
        if not self.adv_clip_max > 0:
            raise ValueError(f"actor.adv_clip_max must be > 0 (inf: no clamp), got {self.adv_clip_max}")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"actor.ema_decay must be in [0, 1] or null, got {self.ema_decay}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    """A finite number > 0 (>= 0 with ``allow_zero``); NaN and inf fail."""
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{key} must be {'>=' if allow_zero else '>'} 0 and finite, got {value}")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")

"""Schema of `flowloop train`: model, data, rollout, actor, advantage and trainer settings.

Defaults are the embedded shapes recipe, chosen so the default run learns on a laptop CPU;
``flowloop train rollout.n=8 actor.lr=2e-5`` overrides any key, a YAML file (``--config``) a
whole recipe. Every value is checked once, in `TrainConfig.validate`, with the key in the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from flowloop.config.rollout import RolloutConfig

KL_MODES = ("flow_grpo", "exact")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
FINETUNE_MODES = ("full", "lora")
ACTOR_OBJECTIVES = ("flow_grpo", "nft")
LR_SCHEDULES = ("constant", "linear", "cosine")
RESUME_MODES = ("never", "auto")


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local model folder in diffusers layout; None = the embedded shapes model."""
    device: str = "cpu"
    """Where the model runs (``cpu``, ``cuda``, ``cuda:1``)."""
    dtype: str = "float32"
    """Weights' dtype: ``float32`` (CPU, exact replay), ``bfloat16`` or ``float16`` (GPU). The
    sampler's latents and log-prob math stay float32 whatever this is."""
    gradient_checkpointing: bool = False
    """Recompute the denoiser's activations in the backward pass: less memory, ~30% slower updates."""
    options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model family's adapter (`flowloop.models.ADAPTERS`), e.g.
    ``{guidance: 3.5}`` for FLUX.1-dev's guidance embedding; an unknown key is an error."""


@dataclass
class DataConfig:
    task: Optional[str] = None
    """The task (`flowloop.tasks`): ``shapes``, ``prompt_file`` or another registered one; None
    picks ``prompt_file`` when ``prompt_file`` is set, else ``shapes``. The task checks the keys it reads."""
    train_split: str = "train"
    """Shapes-world split the training prompts come from (never the held-out one)."""
    val_split: str = "heldout"
    """Split validation reports accuracy on."""
    prompts_per_step: int = 16
    """Distinct prompts per RL step; each is sampled ``rollout.n`` times (a group)."""
    prompt_file: Optional[str] = None
    """Train prompts from a local file (``.txt``, one per line, or ``.jsonl`` with ``prompt``; see
    `flowloop.tasks.prompt_file`) instead of the shapes world; for real models."""
    val_prompt_file: Optional[str] = None
    """Validation prompts (same formats) scored with the training reward; None with a
    ``prompt_file`` validates on that file's first ``val_train_prompts`` prompts."""
    val_train_prompts: int = 32
    """With a ``prompt_file`` and no ``val_prompt_file``: how many of the training file's first
    prompts validation samples (one sample each, at fixed seeds)."""
    negative_prompt: Optional[str] = None
    """The negative prompt of every row, for true CFG (``rollout.pipeline.guidance_scale > 1``);
    None = plain CFG against the empty prompt. Qwen-Image recommends ``" "``."""
    prompt_sampling: str = "uniform"
    """``uniform`` over the split's prompts, or ``category_balanced``: a category first, then one of
    its prompts, so every category trains equally (held-out accuracy is the mean over categories,
    and 135 of the 179 train prompts are colour-attribution ones)."""
    category_weights: Optional[Dict[str, float]] = None
    """With ``category_balanced``: relative weights of the categories named (others keep 1.0),
    e.g. ``{color_attr: 2, single_object: 0.5}`` to spend more samples where accuracy is lowest.
    None draws every category equally."""


@dataclass
class ActorConfig:
    objective: str = "flow_grpo"
    """``flow_grpo``: the clipped policy gradient on the SDE window's log-probs. ``nft``:
    DiffusionNFT (`flowloop.trainer.losses.nft_loss`), the flow-matching loss on the rollout's
    clean samples weighted by advantage; needs no log-probs, so any sampler works, the ODE the
    evaluation samples with included (``rollout.algo.sampler=ode``); ``clip_range``,
    ``timestep_fraction`` and the SDE window settings are then unused."""
    nft_beta: float = 1.0
    """DiffusionNFT's beta: how far the implicit positive/negative policies sit from the old one
    (smaller = a stronger pull per unit of advantage, a wider trust region)."""
    nft_timesteps: int = 2
    """Noise levels drawn per row and update (each one forward and backward, like a window step)."""
    nft_time_range: List[float] = field(default_factory=lambda: [0.0, 1.0])
    """``[lo, hi]``: the noise levels t are drawn uniformly in it (1 = pure noise)."""
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
    batch makes; dropped zero-variance groups or a skipped update make fewer, so such a run ends a
    little above it; changing trainer.total_steps on resume reshapes the remaining decay).
    Constant is flow_grpo's choice; a decay lets a short run settle instead of stopping mid-drift."""
    lr_final_ratio: float = 0.0
    """The decayed schedules' final lr as a share of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay; 0 because the KL term already keeps the policy near the base."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip per optimizer step (a non-finite norm skips the step)."""
    clip_range: float = 1e-4
    """PPO ratio clip; flow_grpo's published value for per-element-mean log-probs."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen base model; 0 skips the reference pass."""
    kl_mode: str = "flow_grpo"
    """``flow_grpo`` (squared mean gap over 2 s^2, s without sqrt(-dt)) or ``exact`` (Gaussian KL)."""
    micro_batch_size: int = 32
    """Rows per forward/backward pass."""
    mini_batch_size: int = 64
    """Rows per optimizer step (gradients of micro-batches accumulate)."""
    inner_epochs: int = 1
    """Passes over each RL batch."""
    timestep_fraction: float = 1.0
    """Share of each row's recorded (SDE-window) steps trained on, taken in order."""
    ema_decay: Optional[float] = None
    """EMA of the trained weights, updated after every optimizer step, swapped in for validation
    and kept in checkpoints; None = off (validation sees the live weights)."""
    skip_old_logprob: bool = True
    """Use the rollout's log-probs as logp_old (exact with colocated weights: see the
    rollout-correction metric) instead of a separate no-grad replay."""


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    """grpo | global_std | drgrpo | per_prompt (`flowloop.trainer.advantages`)."""
    drop_zero_std_groups: bool = False
    """Skip groups whose rewards are all equal (they carry no signal)."""


@dataclass
class TrainerConfig:
    total_steps: int = 60
    """RL steps (each: rollout, advantages, update)."""
    val_every: int = 10
    """Validate every k steps (and before the first and after the last)."""
    val_samples_per_category: int = 32
    """Validation samples per category, 4 seeds per held-out prompt in turn (32: 8 prompts): equal
    precision for the 1-prompt and the 45-prompt categories (accuracy is their mean)."""
    save_every: int = 20
    """Checkpoint every k steps (and at the end)."""
    keep_last: Optional[int] = 2
    """Checkpoints kept (older ones are pruned); None keeps all."""
    run_root: str = "runs"
    run_name: str = "shapes"
    """The run folder is ``run_root/run_name`` (``-1``, ``-2`` ... appended if it exists)."""
    resume: str = "never"
    """``never``, ``auto`` (newest valid checkpoint of ``run_root/run_name``) or a checkpoint path."""
    seed: int = 0
    """Seeds prompt sampling and the optimizer's initial state; rollouts use ``rollout.seed``."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the run folder."""
    wandb: bool = False
    """Also log to wandb (extra ``wandb``); the run id is kept for resume."""
    num_threads: Optional[int] = None
    """torch intra-op threads; None keeps torch's default (all cores)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model folder, on which device."""
    data: DataConfig = field(default_factory=DataConfig)
    """Which prompts train and which validate."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling, agent loops, rewards (`flowloop.config.rollout`)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy update: optimizer, clipping, KL, LoRA."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """How rewards become advantages."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, validation, checkpoints, logging."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad key and what it accepts."""
        self.rollout.validate()
        _choice("actor.finetune", self.actor.finetune, FINETUNE_MODES)
        _choice("model.dtype", self.model.dtype, MODEL_DTYPES)
        _choice("actor.kl_mode", self.actor.kl_mode, KL_MODES)
        _choice("actor.objective", self.actor.objective, ACTOR_OBJECTIVES)
        self._validate_objective()
        _choice("actor.lr_schedule", self.actor.lr_schedule, LR_SCHEDULES)
        if not 0.0 <= self.actor.lr_final_ratio <= 1.0:
            raise ValueError(f"actor.lr_final_ratio must be in [0, 1], got {self.actor.lr_final_ratio}")
        if self.actor.lr_final_ratio and self.actor.lr_schedule == "constant":
            raise ValueError(f"actor.lr_final_ratio={self.actor.lr_final_ratio} has no effect with actor.lr_schedule=constant; "
                             "set actor.lr_schedule=linear or cosine")
        if self.trainer.resume not in RESUME_MODES and "/" not in self.trainer.resume:
            raise ValueError(f"trainer.resume must be one of {list(RESUME_MODES)} or a checkpoint path, got {self.trainer.resume!r}")
        from flowloop.trainer.advantages import ADVANTAGES

        _choice("advantage.estimator", self.advantage.estimator, sorted(ADVANTAGES))
        positive = {
            "data.prompts_per_step": self.data.prompts_per_step, "actor.micro_batch_size": self.actor.micro_batch_size,
            "actor.mini_batch_size": self.actor.mini_batch_size, "actor.inner_epochs": self.actor.inner_epochs,
            "actor.lr": self.actor.lr, "actor.clip_range": self.actor.clip_range, "trainer.total_steps": self.trainer.total_steps,
            "trainer.val_every": self.trainer.val_every, "trainer.save_every": self.trainer.save_every,
            "trainer.val_samples_per_category": self.trainer.val_samples_per_category, "rollout.n": self.rollout.n,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.actor.mini_batch_size % self.actor.micro_batch_size:
            raise ValueError(f"actor.mini_batch_size={self.actor.mini_batch_size} must be a multiple of "
                             f"actor.micro_batch_size={self.actor.micro_batch_size}")
        if not 0 < self.actor.timestep_fraction <= 1:
            raise ValueError(f"actor.timestep_fraction must be in (0, 1], got {self.actor.timestep_fraction}")
        if self.actor.ema_decay is not None and not 0.0 <= self.actor.ema_decay <= 1.0:
            raise ValueError(f"actor.ema_decay must be in [0, 1] or null, got {self.actor.ema_decay}")
        if self.actor.kl_coef < 0:
            raise ValueError(f"actor.kl_coef must be >= 0, got {self.actor.kl_coef}")
        if not self.rollout.calculate_log_probs:
            raise ValueError("rollout.calculate_log_probs must be true for training: the update needs the recorded latents")

    def _validate_objective(self) -> None:
        """The DiffusionNFT settings, and the samplers each objective can learn from."""
        actor = self.actor
        if actor.nft_beta <= 0:
            raise ValueError(f"actor.nft_beta must be > 0, got {actor.nft_beta}")
        if actor.nft_timesteps < 1:
            raise ValueError(f"actor.nft_timesteps must be >= 1, got {actor.nft_timesteps}")
        bounds = list(actor.nft_time_range)
        if len(bounds) != 2 or not 0.0 <= bounds[0] < bounds[1] <= 1.0:
            raise ValueError(f"actor.nft_time_range must be [lo, hi] with 0 <= lo < hi <= 1, got {bounds}")
        if actor.objective == "nft" and not 0 < actor.adv_clip_max < float("inf"):
            raise ValueError(f"actor.objective=nft maps advantages to [0, 1] by actor.adv_clip_max, which must be "
                             f"finite and > 0, got {actor.adv_clip_max}")
        if actor.objective == "flow_grpo" and self.rollout.algo.sampler == "ode":
            raise ValueError("rollout.algo.sampler=ode records no log-probs for flow_grpo to learn from; "
                             "use sde, dance or cps, or set actor.objective=nft")
        if actor.objective == "flow_grpo" and self.rollout.algo.noise_level == 0:
            raise ValueError("rollout.algo.noise_level=0 samples without noise, so flow_grpo has no log-probs to learn "
                             "from; raise it or set actor.objective=nft")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")

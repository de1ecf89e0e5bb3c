"""Schema of `flowloop train`: model, data, rollout, actor, advantage and trainer settings.

Defaults are the embedded shapes recipe, chosen so the default run learns on a laptop CPU;
``flowloop train rollout.n=8 actor.lr=2e-5`` overrides any key, a YAML file (``--config``) a
whole recipe. Every value is checked once, in `TrainConfig.validate`, with the key in the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from flowloop.config.actor import ActorConfig
from flowloop.config.rollout import RolloutConfig
from flowloop.config.scale import ScaleConfig

MODEL_DTYPES = ("float32", "bfloat16", "float16")
RESUME_MODES = ("never", "auto")
GROUP_ESTIMATORS = ("grpo", "global_std", "drgrpo")
"""Advantage estimators that compare a sample with the other samples of its prompt's group."""


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
    tf32: bool = True
    """On CUDA, run float32 matmuls on tensor cores as TF32 (``torch.backends.cuda.matmul.allow_tf32``):
    the float32 LoRA adapters' branch of a bf16 model, in rollout and replay alike, so the
    rollout-vs-replay gap stays what bf16 makes it (docs/results.md, "GPU levers"). False: full
    float32 matmuls, e.g. for a float32 model compared bit for bit with another run. It is set
    for the whole process, so in local mode float32 reward models on the GPU use it too. No effect on CPU."""
    compile: Any = False
    """``true``: ``torch.compile`` each repeated transformer block of the denoiser, for rollout and
    update, and an image VAE's decoder for the rollout (`flowloop.models.compiled`). ``rollout``:
    the same, but the blocks run compiled only in calls without gradients (the rollout, a KL
    reference forward) and eager in the update, which then compiles no backward graphs.
    Costs compile time at the first batches and again at each new batch shape, so it is off
    unless asked for."""
    autocast: bool = False
    """Run the denoiser's forward, rollout and update alike, under ``torch.autocast`` in
    ``dtype`` (bfloat16 or float16 only): the float32 LoRA adapters' matmuls then run in that
    dtype while the optimizer still steps float32 weights (`flowloop.models.autocast`). Off by
    default (a float32 CPU model gains nothing); the GPU recipes turn it on."""
    cudnn_attention: bool = True
    """Let torch's scaled-dot-product attention pick its cuDNN kernel on CUDA. False turns that
    kernel off for the whole process (``torch.backends.cuda.enable_cudnn_sdp``): FLUX.1's
    backward pass fails inside it on torch 2.11 (a CUDA illegal memory access), and SDPA then
    takes its flash or memory-efficient kernel instead."""
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
    """Train prompts from a local file (``.txt``, one per line; ``.jsonl`` with ``prompt``; or a verl
    dataset's ``.parquet``; see `flowloop.tasks.prompt_file`) instead of the shapes world; for real models."""
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
    """Validation samples per category, 4 seeds per held-out prompt in turn (32: 8 prompts, spread
    evenly over the category's 36 to 48): equal precision for every category (accuracy is their mean)."""
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
    """Also write TensorBoard event files into the run folder: the step metrics and the validation grids."""
    wandb: bool = False
    """Also log to wandb (extra ``wandb``): the step metrics, validation grids as images, and this
    whole config; the run id is kept for resume."""
    wandb_project: str = "flowloop"
    """The wandb project the run is logged under (``trainer.wandb=true``)."""
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
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    """Where the processes go: one (local) or a Ray cluster (`flowloop.config.scale`)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad key and what it accepts."""
        self.rollout.validate()
        self.scale.validate()
        if self.scale.mode == "ray" and self.actor.ema_decay is not None:
            raise ValueError("actor.ema_decay is not offered with scale.mode=ray (validation samples on the replicas, "
                             "which hold the live weights); unset it or use scale.mode=local")
        if self.rollout.max_staleness > 0:
            if self.scale.mode == "ray" and self.scale.placement == "colocated":
                raise ValueError("rollout.max_staleness > 0 needs scale.placement=disaggregated with scale.mode=ray: a "
                                 "colocated replica samples with the weights its rank is updating")
            if self.actor.ema_decay is not None:
                raise ValueError("actor.ema_decay is not offered with rollout.max_staleness > 0 (validation samples on the "
                                 "replica's own copy of the weights); unset one of them")
        _choice("model.dtype", self.model.dtype, MODEL_DTYPES)
        if not isinstance(self.model.compile, bool) and self.model.compile != "rollout":
            raise ValueError(f"model.compile must be true, false or rollout, got {self.model.compile!r}")
        if self.model.autocast and self.model.dtype == "float32":
            raise ValueError("model.autocast needs model.dtype bfloat16 or float16 (a float32 model gains nothing); "
                             "set model.autocast=false or model.dtype=bfloat16")
        self.actor.validate()
        self._validate_objective()
        if self.trainer.resume not in RESUME_MODES and "/" not in self.trainer.resume:
            raise ValueError(f"trainer.resume must be one of {list(RESUME_MODES)} or a checkpoint path, got {self.trainer.resume!r}")
        from flowloop.trainer.advantages import ADVANTAGES

        _choice("advantage.estimator", self.advantage.estimator, sorted(ADVANTAGES))
        positive = {
            "data.prompts_per_step": self.data.prompts_per_step, "trainer.total_steps": self.trainer.total_steps,
            "trainer.val_every": self.trainer.val_every, "trainer.save_every": self.trainer.save_every,
            "trainer.val_samples_per_category": self.trainer.val_samples_per_category, "rollout.n": self.rollout.n,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.rollout.n == 1 and self.advantage.estimator in GROUP_ESTIMATORS:
            raise ValueError(f"rollout.n=1 with advantage.estimator={self.advantage.estimator}: each group holds one sample, so "
                             "every advantage is 0 and nothing trains; set rollout.n >= 2 (8 is usual), or "
                             "advantage.estimator=per_prompt (compares each prompt with its own earlier samples)")
        if not self.rollout.calculate_log_probs:
            raise ValueError("rollout.calculate_log_probs must be true for training: the update needs the recorded latents")

    def _validate_objective(self) -> None:
        """``actor.objective`` is registered, and the rollout records what it learns from (the
        objective says: e.g. FlowGRPO needs a noisy sampler's log-probs)."""
        from flowloop.trainer.objectives import get_objective, objective_names

        _choice("actor.objective", self.actor.objective, objective_names())
        get_objective(self.actor.objective).validate_config(self)


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")

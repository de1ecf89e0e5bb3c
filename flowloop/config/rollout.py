"""Schemas of the rollout side of a training step: how images are sampled, how agent loops run,
how rewards are scored. Read by `flowloop.agent_loop` (workers and manager) and `flowloop.reward`.

Sampling settings come in two groups that merge, in this order, into one request's
`flowloop.rollout.types.SamplingParams`:

    pipeline (how an image is made)  +  algo (how the trajectory is explored)
    + val_kwargs.pipeline / val_kwargs.algo   (validation only)
    + logprobs, seed, noise_seed, global_steps  (set per row by the agent-loop worker)

Load with ``load_config(RolloutConfig, overrides, yaml_files)`` from `flowloop.config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

FAILURE_POLICIES = ("fail", "drop_group")


@dataclass
class PipelineConfig:
    """How one image is made. Defaults fit the embedded shapes model (32 x 32 pixels)."""

    height: int = 32
    """Image height in pixels; the embedded model is trained at 32."""
    width: int = 32
    """Image width in pixels; the embedded model is trained at 32."""
    num_frames: Optional[int] = None
    """Frames per video; None makes images."""
    num_inference_steps: int = 10
    """Denoising steps per sample; 10 is Flow-GRPO's published training setting."""
    guidance_scale: float = 1.0
    """Classifier-free guidance; 1.0 runs no unconditional pass (the embedded model needs none)."""
    shift: Any = 1.0
    """Sigma shift: a number > 0 (SD3-style ``s t / (1 + (s - 1) t)``; 1.0 keeps the linear schedule
    the embedded model was trained on), or ``auto``: the model's own scheduler config decides, at
    the sampled resolution (FLUX / Qwen-Image: diffusers' dynamic shift, ``exp(mu)`` from the
    image token count; SD3 / Wan: their fixed shift; no scheduler config: 1.0)."""


@dataclass
class AlgoConfig:
    """How the trajectory is explored for RL: the stochastic sampler and where it runs."""

    sampler: str = "sde"
    """One of ode, sde, cps, dance (`flowloop.sampling`); sde is Flow-GRPO's."""
    noise_level: float = 0.7
    """SDE noise level ``a``; 0.7 is Flow-GRPO's published value for sde (use 0.8 for cps)."""
    sde_window_size: Optional[int] = None
    """Consecutive SDE steps (log-probs there only, Flow-GRPO-Fast); None = every step but the last."""
    sde_window_range: Optional[List[int]] = None
    """``[lo, hi)``: steps the window's start is drawn from; None = the whole trajectory."""
    logprob_mode: str = "density"
    """CPS only: "density" (true Gaussian log-prob) or "flow_grpo" (the public code's -||x'-mean||^2)."""


@dataclass
class ValKwargs:
    """Validation overrides: deterministic, higher-quality samples at fixed seeds, no log-probs."""

    pipeline: Dict[str, Any] = field(default_factory=lambda: {"num_inference_steps": 40})
    """Keys of `PipelineConfig` to override; 40 steps is the published evaluation setting."""
    algo: Dict[str, Any] = field(default_factory=lambda: {"sampler": "ode"})
    """Keys of `AlgoConfig` to override; the ODE sampler makes validation noise-free after the start."""
    seed: int = 0
    """Base of the validation seeds: row r gets ``row_seed(seed, VALIDATION_STEP, r)`` every time."""


@dataclass
class ServerConfig:
    """Dynamic batching in each rollout replica (`flowloop.rollout.RolloutServer`)."""

    max_batch_size: int = 16
    """Most requests one engine call samples together; 16 fills a CPU without long queues."""
    max_wait_ms: float = 250.0
    """How long the oldest queued request waits for its batch to fill when no caller has flushed
    it. Agent-loop workers flush their rows as soon as all of them are waiting on the replica
    (`RolloutServer.flush`), so a step's batches form on the flush, not on this clock; it bounds
    the wait for requests sent any other way. It must outlast the spread of one worker's requests
    reaching a replica: through Ray, after an update, 16 rows took more than 50 ms to arrive, and
    a clock that fires first splits the step's batch (measured with benchmarks/scale_gpu.py --tiny:
    two batches of 8 at 50 ms, one of 16 at 250 ms)."""
    cpu_shards: Optional[int] = None
    """On a CPU, a batch of at least 16 rows runs as up to this many slices side by side, each
    on its share of the intra-op threads (a slice has 8 rows or more; `RolloutEngine`). None:
    one single-thread slice per intra-op thread when there are at most 2, none on larger CPUs
    (measurements: docs/lab-notebook.md); 1: off. Ignored on a GPU. Results do not change."""


@dataclass
class AgentConfig:
    """Which agent loop runs each row, and how many workers run them."""

    default_agent_loop: str = "single_turn"
    """Loop for rows without an ``agent_name`` column (see `flowloop.agent_loop.registry`)."""
    agent_loop_config_path: Optional[str] = None
    """YAML list of ``{name, _target_, ...kwargs}`` registering loops defined outside flowloop."""
    num_workers: int = 1
    """AgentLoopWorkers the batch is split over. One is enough locally (one event loop); in Ray
    mode more spread tokenising, stacking and reward dispatch over processes."""


@dataclass
class RewardConfig:
    """The streaming reward: which function scores each sample as soon as it is generated."""

    name: Optional[str] = "shapes"
    """A registered reward (`flowloop.reward.registry`; e.g. shapes, jpeg_compressibility,
    combined, remote) or ``package.module:function``; None scores nothing (no ``rm_scores``)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """The reward's keyword arguments: a factory reward is built with them once per worker, a
    plain function gets them on every call (`flowloop.reward.registry.build_reward`). Examples:
    ``{device: cuda:0}``; ``{url: "http://host:8000", timeout_s: 30}`` for ``remote``;
    ``{components: {shapes: 1.0, jpeg_compressibility: 0.1}}`` for ``combined`` (a weighted sum,
    each part logged as ``reward/<part>``; see `flowloop.reward.combine`)."""
    num_workers: int = 1
    """RewardWorkers; rows go to worker ``global_row_index % num_workers``. More workers score
    in parallel (threads locally, processes in Ray mode)."""
    max_batch_size: int = 16
    """Most samples one call of the reward function scores."""
    max_wait_ms: float = 0.0
    """How long a worker waits to fill a batch. 0: no added latency; samples that arrive while a
    batch is being scored form the next one anyway. Raise it for a GPU reward model."""
    timeout_s: Optional[float] = 600.0
    """Most seconds one call of the reward function may take (a remote reward's retries
    included); past it every row of that batch fails (``reward_error``) and ``failure_policy``
    decides. Generous, for a reward model's first call; null: no limit."""
    failure_policy: str = "fail"
    """When a reward function raises for a row: "fail" the step (the error names the row), or
    "drop_group": drop every row sharing that row's ``uid`` and go on. Never a silent 0."""


@dataclass
class RolloutConfig:
    """Everything the agent-loop layer reads; see the module docstring for how sampling merges."""

    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """How an image is made (resolution, steps, guidance)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """How the trajectory is explored (sampler, noise, SDE window)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Batching in each rollout replica."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """What validation changes: ODE, more steps, fixed seeds, no log-probs."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent loops and agent-loop workers."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The streaming reward and its failure policy."""
    prompt_length: Optional[int] = None
    """Prompt token ids are left-padded to this; a longer prompt is an error naming the row.
    None = the model's ``max_sequence_length`` (the embedded model: 16)."""
    max_sequence_length: Optional[int] = None
    """Prompt embeddings are right-padded to this; longer is an error naming the row.
    None = the model's ``max_sequence_length``."""
    n: int = 8
    """Samples per prompt in training: one GRPO group. Validation samples each of the task's
    validation rows once (`flowloop.tasks`)."""
    calculate_log_probs: bool = True
    """Record per-step log-probs in training (FlowGRPO's ``logp_old``). Validation never does."""
    seed: int = 0
    """Base of the training seeds: row r of step s gets ``row_seed(seed, s, r)``."""
    max_staleness: int = 0
    """Updates a training row may lag the trainer. 0: on-policy, every step samples with the
    weights of the update just made. > 0 (async mode): step s+1's rows start sampling, with the
    weights the replicas hold (update s-1), before step s's update, and train one update old;
    the replicas take update s's weights once those rows are done, never in the middle of them.
    The pipeline runs one step ahead, so any value >= 1 gives rows exactly 1 update old. Rows
    record the version they were sampled with (``rollout/weight_version``, ``rollout/staleness``);
    FlowGRPO must then take logp_old from the rollout (``actor.flow_grpo.skip_old_logprob``), and
    ``rollout_correction/*`` shows how far the sampling policy was from the trained one. The gain
    is with ``scale.mode=ray scale.placement=disaggregated`` (replicas on devices of their own);
    locally the rollout and the update share one compute thread and overlap little, and the
    replica is a second copy of the model. A checkpoint holds no batch in flight: a resumed run
    samples its first step with the restored weights, then runs ahead again."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad key; called by `load_config` and the workers."""
        for key in ("prompt_length", "max_sequence_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 (or null for the model's own), got {value}")
        for key in ("agent.num_workers", "reward.num_workers", "reward.max_batch_size", "server.max_batch_size",
                    "pipeline.num_inference_steps"):
            section, name = key.split(".")
            if getattr(getattr(self, section), name) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(getattr(self, section), name)}")
        if self.server.cpu_shards is not None and self.server.cpu_shards < 1:
            raise ValueError(f"server.cpu_shards must be >= 1 (1: off) or null (auto: one per thread on a CPU with <= 2), got {self.server.cpu_shards}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0: on-policy), got {self.max_staleness}")
        for key, value in (("reward.max_wait_ms", self.reward.max_wait_ms), ("server.max_wait_ms", self.server.max_wait_ms)):
            if value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
        timeout = self.reward.timeout_s
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ValueError(f"reward.timeout_s must be a number of seconds > 0 (or null: no limit), got {timeout}")
        if self.reward.kwargs and self.reward.name is None:
            raise ValueError(f"reward.kwargs is set ({sorted(self.reward.kwargs)}) but reward.name is null; set both or neither")
        if self.reward.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"reward.failure_policy must be one of {list(FAILURE_POLICIES)}, got {self.reward.failure_policy!r}")
        _check_shift("pipeline.shift", self.pipeline.shift)
        # val_kwargs are free dicts: check their keys and types against the typed sections once, here.
        for section, schema in (("pipeline", PipelineConfig), ("algo", AlgoConfig)):
            self._validation_section(section, schema)
        _check_shift("val_kwargs.pipeline.shift", self._validation_section("pipeline", PipelineConfig).shift)

    def sampling_dict(self, validate: bool) -> dict[str, Any]:
        """The merged ``pipeline`` + ``algo`` (+ ``val_kwargs`` when validating) settings and
        ``logprobs``: every `SamplingParams` field but the per-row ``seed``, ``noise_seed`` and ``global_steps``."""
        values = {**dataclasses.asdict(self.pipeline), **dataclasses.asdict(self.algo)}
        if validate:
            values.update(dataclasses.asdict(self._validation_section("pipeline", PipelineConfig)))
            values.update(dataclasses.asdict(self._validation_section("algo", AlgoConfig)))
        values["logprobs"] = self.calculate_log_probs and not validate
        return values

    def _validation_section(self, section: str, schema: type):
        overrides = getattr(self.val_kwargs, section)
        known = [f.name for f in dataclasses.fields(schema)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"val_kwargs.{section} has unknown key(s) {unknown}; known: {known}")
        try:
            merged = OmegaConf.merge(OmegaConf.structured(getattr(self, section)), dict(overrides))
        except OmegaConfBaseException as err:
            raise ValueError(f"val_kwargs.{section}: {str(err).splitlines()[0]}") from None
        return OmegaConf.to_object(merged)


def _check_shift(key: str, value: Any) -> None:
    """``auto`` or a finite number > 0 (``Any`` in the schema: OmegaConf has no float-or-str type)."""
    if value == "auto":
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    if not ok:
        raise ValueError(f"{key} must be a number > 0 or 'auto' (the model's own scheduler shift), got {value!r}")

"""`RolloutEngine`: run one batch of rollout requests on a `FlowModel`, synchronously.

For each request: its own `torch.Generator` (seeded from the request), its own SDE window, its
own initial noise; the batch shares the text encoder pass (each distinct prompt encoded once) and
every denoiser call. Rows step with the SDE inside their window and with Euler outside it, so
requests with different windows share a batch. Everything a row's result depends on is its own,
so a request gives the same sample alone or in any batch, as far as the model's kernels do not
depend on the row count (the embedded model's do not: bitwise, see
`tests/rollout/test_engine.py::test_batch_invariance`). For the same reason a large batch on a
CPU can run as slices on separate threads, each with its share of the cores (``cpu_shards``):
for a small model on two cores that beats splitting every op across them.

A request's generator is used in this fixed order: (1) the SDE window start (only when
``sde_window_size`` is set), (2) the initial noise (unless ``noise_seed`` is set: then a
generator of its own draws it), (3) the noise of each SDE step, in step order. Generators live on
the CPU, so one seed gives the same sample on the CPU and on a GPU.

Latents stay float32 end to end (the adapter casts them to its own dtype inside ``velocity``); the
recorded latents and sigmas are the exact tensors stepped with, so the trainer's replay through
`guided_velocity` and the same step function reproduces a recorded log-prob bit for bit when it
runs the same weights and kernels on the same batch shape.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flowloop.compute import shard_executor
from flowloop.models.base import FlowModel, SchedulerShift
from flowloop.models.prompt_ids import encode_chat
from flowloop.rollout.types import DiffusionOutput, RolloutRequest, SamplingParams
from flowloop.sampling import (
    apply_cfg, get_step, needs_uncond, ode_step, randn_per_sample, resolution_shift_mu, sde_window, sigmas,
)

__all__ = ["AUTO_SHARD_MAX_THREADS", "MIN_SHARD_ROWS", "NEGATIVE", "RolloutEngine", "guided_velocity"]

MIN_SHARD_ROWS = 8
"""Fewest rows a CPU slice gets: smaller slices lose more to per-op overhead than a second
thread costs (and, on the 2-core machine the benchmarks name, give other last bits)."""

AUTO_SHARD_MAX_THREADS = 2
"""``cpu_shards=None`` slices only on a CPU with this many intra-op threads or fewer. Measured
with benchmarks/rollout_server.py: on 2 AMD EPYC cores slices gave 2.59x -> 3.01x at batch 16
and 25% shorter sampling in `flowloop train`; on an Intel Xeon, 2 threads moved within noise,
4 threads gained 9% at batch 16 and lost 8% at 64, and 16 threads lost 16% and 52% (slices of
several threads each form OpenMP teams that outnumber the cores)."""

PHASES = ("prompts", "denoise", "decode", "outputs")
"""Where a batch's time goes: noise and prompt encoding, the denoising loop, the VAE decode, the
copies of each row's results to the host."""

NEGATIVE = "negative_"
"""Prefix of the negative (or empty) prompt's conditioning fields, used with CFG."""


def guided_velocity(
    model: FlowModel,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    embeds: dict[str, torch.Tensor],
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """The velocity a sampler steps with; the trainer's replay must call this same function.

    ``embeds``: the conditional fields of `FlowModel.encode_prompt` (``prompt_embeds``, ...)
    and, with CFG, the same fields of the negative (or empty) prompt prefixed ``negative_``.
    ``guidance_scale <= 1``: the conditional velocity. Otherwise CFG, with the conditional and
    negative rows in one denoiser call of ``2B`` rows (``[cond; negative]``), then the model's
    ``combine_guidance`` when it has one, else ``apply_cfg``. ``latents [B, ...]``, ``sigma [B]``, every embedding ``[B, ...]``.
    """
    cond = {k: v for k, v in embeds.items() if not k.startswith(NEGATIVE)}
    if not needs_uncond(guidance_scale):
        return model.velocity(latents, sigma, cond)
    missing = [NEGATIVE + k for k in cond if NEGATIVE + k not in embeds]
    if missing:
        raise ValueError(f"guidance_scale={guidance_scale} > 1 needs {missing}")
    both = {k: torch.cat([v, embeds[NEGATIVE + k]]) for k, v in cond.items()}
    v = model.velocity(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both)  # [2B, ...]
    v_cond, v_uncond = v.chunk(2)
    combine = getattr(model, "combine_guidance", None)  # a family's own CFG rule (Qwen-Image rescales)
    return combine(v_cond, v_uncond, guidance_scale) if combine else apply_cfg(v_cond, v_uncond, guidance_scale)


@dataclass
class _Record:
    """One row's trajectory inside its SDE window."""

    latents: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    timesteps: list[torch.Tensor] = field(default_factory=list)
    next_timesteps: list[torch.Tensor] = field(default_factory=list)


class RolloutEngine:
    """Batched sampling over a `FlowModel`: ``sample(requests) -> [DiffusionOutput]``."""

    def __init__(self, model: FlowModel, cpu_shards: int | None = 1, device_rows: bool = False):
        """``cpu_shards``: on a CPU, run a batch as up to this many slices side by side, each on
        its own share of the intra-op threads (`flowloop.compute.shard_executor`, which starts
        threads of its own); a slice gets at least ``MIN_SHARD_ROWS`` rows. 1 (the default):
        never slice, start no threads. None: one slice per intra-op thread on a CPU with at most
        ``AUTO_SHARD_MAX_THREADS`` of them, else none (what ``rollout.server.cpu_shards`` gives
        `flowloop train` by default). A row's result does not depend on the slicing (batch
        invariance). The engine changes nothing process-wide; `flowloop.allocator` is the
        caller's to opt into. ``device_rows``: a training row's rollout tensors (prompt embeddings,
        latents, timesteps) stay on the model's device instead of coming to the host; for a
        replica whose training rows are held for an update in its own process
        (`flowloop.trainer.held_rows`), where the round trip through the host is all cost. Images
        and log-probs always come to the host."""
        if cpu_shards is not None and (isinstance(cpu_shards, bool) or not isinstance(cpu_shards, int) or cpu_shards < 1):
            raise ValueError(f"cpu_shards must be None (auto) or an int >= 1, got {cpu_shards!r}")
        self.model = model
        self.cpu_shards = cpu_shards
        self.device_rows = device_rows
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        """Seconds spent in each of `PHASES` over every batch so far (device work included)."""
        self._empty_prompt_ids = encode_chat(model.tokenizer, [{"role": "user", "content": ""}])  # the unconditional prompt

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (names of the model's trainable module: every weight, or LoRA adapters
        only) into the weights this engine samples with. A name the module lacks is an error:
        a replica built without the trainer's LoRA layout would otherwise sample a stale policy."""
        params = self.model.trainable_module().state_dict(keep_vars=True)
        unknown = [name for name in state if name not in params]
        if unknown:
            raise ValueError(f"weights {unknown[:3]} (of {len(state)}) are not in the rollout model's denoiser; "
                             "was it built with the trainer's finetune mode and LoRA settings?")
        for name, value in state.items():
            params[name].copy_(value)

    # -- intake -------------------------------------------------------------------------
    def validate(self, request: RolloutRequest) -> None:
        """Raise a ValueError naming the field if ``request`` cannot run on this model."""
        params = request.sampling_params
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request.request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        try:
            self.model.latent_shape(params.height, params.width, params.num_frames)
        except ValueError as err:
            raise ValueError(f"sampling_params.height/width/num_frames: {err}") from None
        self._check_ids("prompt_ids", request.prompt_ids)
        if request.negative_prompt_ids is not None:
            if not needs_uncond(params.guidance_scale):
                raise ValueError(
                    f"negative_prompt_ids needs guidance_scale > 1 (true CFG), got guidance_scale={params.guidance_scale}"
                )
            self._check_ids("negative_prompt_ids", request.negative_prompt_ids)

    def _check_ids(self, name: str, ids: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor [L] (unpadded), got {_describe(ids)}")
        limit = self.model.max_sequence_length
        if not 1 <= len(ids) <= limit:
            raise ValueError(f"{name} has {len(ids)} tokens; need 1 to max_sequence_length={limit}")
        vocab = len(self.model.tokenizer)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{name} holds ids outside the tokenizer's vocabulary [0, {vocab})")

    # -- sampling -----------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, requests: Sequence[RolloutRequest]) -> list[DiffusionOutput]:
        """Sample a batch of requests sharing ``sampling_params.batch_key()``; outputs in order."""
        start = time.perf_counter()
        # 1. Validate; one batch runs one schedule, one sampler, one resolution.
        if not requests:
            return []
        for request in requests:
            self.validate(request)
        params = requests[0].sampling_params
        if any(r.sampling_params.batch_key() != params.batch_key() for r in requests):
            raise ValueError("requests in one batch must share sampling_params.batch_key() (all but seed)")
        module = self.model.trainable_module()
        device = next(module.parameters()).device
        was_training = module.training
        module.eval()
        try:
            threads = torch.get_num_threads()
            slices = _slices(len(requests), self._shards(device, threads))
            if len(slices) == 1:
                parts = [self._sample_rows(requests, params, device)]
            else:
                pool = shard_executor(len(slices), max(1, threads // len(slices)))
                parts = [f.result() for f in [pool.submit(self._sample_rows, requests[s], params, device) for s in slices]]
        finally:
            module.train(was_training)
        outputs = [out for part_outputs, _ in parts for out in part_outputs]
        for name in PHASES:  # slices run side by side: the slowest one is the batch's time
            self.phase_seconds[name] += max(phases[name] for _, phases in parts)
        metrics = {"generate_time": time.perf_counter() - start, "batch_size": float(len(requests)),
                   "cpu_shards": float(len(slices))}
        for out in outputs:
            out.metrics.update(metrics)
        return outputs

    def _shards(self, device: torch.device, threads: int) -> int:
        """How many slices a large batch may run as: 1 on a GPU; by default one per intra-op
        thread up to ``AUTO_SHARD_MAX_THREADS`` threads, else 1."""
        if device.type != "cpu":
            return 1
        if self.cpu_shards is not None:
            return self.cpu_shards
        return threads if threads <= AUTO_SHARD_MAX_THREADS else 1

    @torch.no_grad()  # again: grad mode is per thread, and shards run on their own threads
    def _sample_rows(self, requests: Sequence[RolloutRequest], params: SamplingParams,
                     device: torch.device) -> tuple[list[DiffusionOutput], dict[str, float]]:
        """Steps 2-5 of `sample` for some rows: noise, prompts, denoising, decoding; and the
        seconds of each of `PHASES`."""
        clock = _PhaseClock(device)
        # 2. Per request: generator, SDE window, initial noise (in this order).
        generators = [torch.Generator("cpu").manual_seed(_seed(r.sampling_params)) for r in requests]
        windows = [self._window(params, g) for g in generators]
        shape = self.model.latent_shape(params.height, params.width, params.num_frames)
        starts = [g if r.sampling_params.noise_seed is None else torch.Generator("cpu").manual_seed(r.sampling_params.noise_seed)
                  for r, g in zip(requests, generators)]
        latents = randn_per_sample(starts, (len(requests), *shape)).to(device)  # [B, *shape]
        # 3. Prompts, each distinct one encoded once.
        keep_on_device = self.device_rows and params.logprobs  # a training row whose update runs here
        embeds, row_embeds = self._encode(requests, needs_uncond(params.guidance_scale), device, keep_on_device)
        clock.lap("prompts")
        # 4. Denoise, recording each row inside its window.
        latents, records = self._denoise(latents, params, generators, windows, embeds)
        clock.lap("denoise")
        # 5. Decode.
        images = self.model.decode(latents).float()  # [B, C, H, W] or [B, T, C, H, W]
        clock.lap("decode")
        outputs = _outputs(requests, images, row_embeds, records if params.logprobs else None, latents, keep_on_device)
        clock.lap("outputs")
        return outputs, clock.seconds

    def _window(self, params: SamplingParams, generator: torch.Generator) -> range:
        if params.sampler == "ode":
            return range(0)
        return sde_window(params.num_inference_steps, params.sde_window_size, params.window_range(), generator)

    def _encode(self, requests: Sequence[RolloutRequest], cfg: bool, device: torch.device,
                keep_on_device: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Per-row prompt (and, with CFG, negative or empty prompt) embeddings ``[B, L, D]`` on the
        device; and the same per row for the outputs, on the host (or, ``keep_on_device``, left on
        the device), where the rows of one prompt share one tensor (a group's rows share one
        prompt: a copy per row would move and store the group's size times the bytes, and a batch
        pickled whole carries each shared tensor once)."""
        rows = [r.prompt_ids for r in requests]
        if cfg:
            rows += [r.negative_prompt_ids if r.negative_prompt_ids is not None else self._empty_prompt_ids for r in requests]
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(ids.tolist()), len(distinct)) for ids in rows]  # [B] or [2B]
        padded = [_pad(torch.tensor(key), self.model) for key in distinct]
        ids = torch.stack([p[0] for p in padded]).to(device)  # [P, L]
        mask = torch.stack([p[1] for p in padded]).to(device)  # [P, L]
        encoded = self.model.encode_prompt(ids, mask)  # each [P, ...]
        on_device = torch.tensor(index, device=encoded["prompt_embeds"].device)
        rows_embeds = {name: value[on_device] for name, value in encoded.items()}  # each [B or 2B, ...]
        per_row = {}
        for name, value in encoded.items():
            distinct_rows = own_rows(value, keep_on_device)
            per_row[name] = [distinct_rows[i] for i in index]
        if not cfg:
            return rows_embeds, per_row
        return _conditional_and_negative(rows_embeds, len(requests)), _conditional_and_negative(per_row, len(requests))

    def _denoise(
        self,
        latents: torch.Tensor,
        params: SamplingParams,
        generators: list[torch.Generator],
        windows: list[range],
        embeds: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, list[_Record]]:
        """Run every step; a row takes the SDE step inside its window, the Euler step outside."""
        step_fn = get_step(params.sampler)
        step_kwargs = {"logprob_mode": params.logprob_mode} if params.sampler == "cps" else {}
        schedule = model_sigmas(self.model, params)  # [N+1] float32
        batch, device = latents.shape[0], latents.device
        device_schedule = schedule.to(device)  # one copy: a per-step host-to-device copy would wait for the GPU
        records = [_Record() for _ in range(batch)]
        for i in range(params.num_inference_steps):
            t, t_next = schedule[i], schedule[i + 1]
            v = guided_velocity(self.model, latents, device_schedule[i].expand(batch), embeds, params.guidance_scale)
            rows = [b for b in range(batch) if i in windows[b]]
            if len(rows) < batch:
                ode = ode_step(v, t, t_next, latents)
            if not rows:
                latents = ode.prev_sample
                continue
            # Noise only for rows in their window, each from its own generator.
            noise = torch.zeros_like(latents)  # [B, ...]
            noise[rows] = randn_per_sample([generators[b] for b in rows], (len(rows), *latents.shape[1:])).to(device)
            sde = step_fn(v, t, t_next, latents, noise_level=params.noise_level, noise=noise, **step_kwargs)
            if len(rows) < batch:
                in_window = torch.zeros(batch, dtype=torch.bool, device=device)
                in_window[rows] = True
                in_window = in_window.view(batch, *([1] * (latents.ndim - 1)))  # [B, 1, ...]
                next_latents = torch.where(in_window, sde.prev_sample, ode.prev_sample)
            else:
                next_latents = sde.prev_sample
            if params.logprobs:
                for b in rows:
                    record = records[b]
                    if not record.latents:
                        record.latents.append(latents[b])
                    record.latents.append(next_latents[b])
                    record.log_probs.append(sde.log_prob[b])
                    record.timesteps.append(t)
                    record.next_timesteps.append(t_next)
            latents = next_latents
        return latents, records


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def model_sigmas(model: FlowModel, params: SamplingParams) -> torch.Tensor:
    """The sigma grid ``[N+1]`` of a request: its numeric ``shift``, or for ``shift="auto"`` the
    model's own scheduler's (`SchedulerShift`) at the request's resolution, as its pipeline computes it."""
    if params.shift != "auto":
        return sigmas(params.num_inference_steps, params.shift)
    rule = getattr(model, "scheduler_shift", None) or SchedulerShift()
    shift = rule.shift
    if rule.dynamic:
        mu = resolution_shift_mu(model.image_seq_len(params.height, params.width), rule.base_seq_len, rule.max_seq_len,
                                 rule.base_shift, rule.max_shift)
        shift = math.exp(mu)
    return sigmas(params.num_inference_steps, shift, shift_terminal=rule.shift_terminal)


def _conditional_and_negative(embeds: dict, batch: int) -> dict:
    """``[2B, ...]`` fields (the prompts', then the negative prompts') -> the ``B`` conditional
    rows under their names and the ``B`` negative ones under ``NEGATIVE`` + name."""
    out = {name: value[:batch] for name, value in embeds.items()}
    out.update({NEGATIVE + name: value[batch:] for name, value in embeds.items()})
    return out


def _slices(batch: int, shards: int) -> list[slice]:
    """Contiguous row ranges of at least ``MIN_SHARD_ROWS`` (one range for a small batch)."""
    count = max(1, min(shards, batch // MIN_SHARD_ROWS))
    bounds = [batch * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _seed(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else secrets.randbits(63)


def _pad(ids: torch.Tensor, model: FlowModel) -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[l]`` -> (ids, mask) ``[max_sequence_length]``, on the tokenizer's padding side."""
    length, pad = model.max_sequence_length - len(ids), model.tokenizer.pad_token_id or 0
    filler = torch.full((length,), pad, dtype=torch.long)
    ones, zeros = torch.ones(len(ids), dtype=torch.long), torch.zeros(length, dtype=torch.long)
    if getattr(model.tokenizer, "padding_side", "right") == "left":
        return torch.cat([filler, ids]), torch.cat([zeros, ones])
    return torch.cat([ids, filler]), torch.cat([ones, zeros])


def _outputs(
    requests: Sequence[RolloutRequest],
    images: torch.Tensor,
    embeds: dict[str, list[torch.Tensor]],
    records: list[_Record] | None,
    final_latents: torch.Tensor,
    keep_on_device: bool = False,
) -> list[DiffusionOutput]:
    """One `DiffusionOutput` a row, each tensor with its own storage (a view would carry, and
    pickle, the whole batch), on the host; with ``keep_on_device`` the rollout tensors (all but
    the image and the log-probs) stay on the device. ``embeds``: each row's embeddings (`_encode`).
    The windowed steps' tensors cross to the host as one copy a field: a copy per row and step
    would wait on the device once each."""
    images = own_rows(images)
    if records is not None:
        finals = own_rows(final_latents, keep_on_device)
        windowed = [b for b, record in enumerate(records) if record.latents]
        stacked = {}
        fields = {"all_latents": "latents", "all_timesteps": "timesteps", "all_next_timesteps": "next_timesteps",
                  "log_probs": "log_probs"}
        for key, attr in fields.items() if windowed else ():
            parts = [torch.stack(getattr(records[b], attr)) for b in windowed]  # timesteps on the host, the rest not
            where = final_latents.device if keep_on_device and key != "log_probs" else "cpu"
            stacked[key] = dict(zip(windowed, torch.cat(parts).to(where).split([len(part) for part in parts])))
    outputs = []
    for b, request in enumerate(requests):
        extra = {name: value[b] for name, value in embeds.items()}  # [L, D] / [L], shared by the rows of a prompt
        log_probs = None
        if records is not None:
            extra["final_latents"] = finals[b]  # [...] the clean latent (DiffusionNFT trains on it)
            log_probs = torch.zeros(0)  # an ODE rollout has no window: W = 0
            if b in stacked.get("log_probs", {}):
                extra["all_latents"] = stacked["all_latents"][b].clone()  # [W+1, ...] float32
                extra["all_timesteps"] = stacked["all_timesteps"][b].clone()  # [W]
                extra["all_next_timesteps"] = stacked["all_next_timesteps"][b].clone()  # [W]
                log_probs = stacked["log_probs"][b].clone()  # [W]
        outputs.append(DiffusionOutput(request.request_id, images[b], log_probs, extra, {}))
    return outputs


def own_rows(batch: torch.Tensor, keep_on_device: bool = False) -> list[torch.Tensor]:
    """``batch [B, ...]`` as B tensors with storage of their own, on the host (or, with
    ``keep_on_device``, where ``batch`` is), each in one copy: from a GPU, a row's copy to the
    host is already its own."""
    if batch.device.type == "cpu" or keep_on_device:
        return [row.clone() for row in batch]
    return [row.cpu() for row in batch]


class _PhaseClock:
    """Seconds between laps, device work included (a CUDA device is synchronized at each lap)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(type(value).__name__)

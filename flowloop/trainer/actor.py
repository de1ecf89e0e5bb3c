"""The actor: one optimizer loop that trains whichever objective ``actor.objective`` names.

`Actor.update` moves the rollout columns the objective reads to the device, lets it draw what
it needs for this update (`Objective.prepare`), then runs ``inner_epochs`` shuffled passes of
micro-batches; each micro-batch gives one loss term per trained step or noise level, gradients
accumulate over ``mini_batch_size`` rows, and each optimizer step clips the gradient norm and
updates the EMA and the lr schedule. A step whose loss or gradient norm is not finite is skipped
before it touches the weights. The objectives (`flowloop.trainer.objectives`) own the loss; the
actor owns the weights: the trainable module, the frozen reference for KL, LoRA and the
velocity every objective replays with (`flowloop.rollout.engine.guided_velocity`, the function
the rollout sampled with).
"""

from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager, nullcontext

import torch

from flowloop.config.actor import ActorConfig
from flowloop.models.base import is_embedding_key
from flowloop.protocol import Batch
from flowloop.rollout.engine import guided_velocity
from flowloop.rollout.types import SamplingParams
from flowloop.trainer.lora import adapters_disabled, add_lora
from flowloop.trainer.objectives import get_objective
from flowloop.trainer.run_folder import apply_to_train_state
from flowloop.trainer.sharding import RankShare, full_value, gather_train_state, load_train_state, read_shards, save_shards

logger = logging.getLogger(__name__)


class Actor:
    """Owns the trainable denoiser's optimizer, the frozen reference and the objective; `update`
    is one RL update."""

    def __init__(self, model, config: ActorConfig, sampling: SamplingParams, total_optimizer_steps: int | None = None,
                 share: RankShare = RankShare(), shard=None):
        """``total_optimizer_steps``: the run's planned optimizer steps, which a decaying
        ``config.lr_schedule`` needs (`optimizer_steps_per_batch` x RL steps). LoRA adapters are
        initialised from torch's global generator: seed it before for a reproducible run.
        ``share``: this rank's place among the trainer ranks (`flowloop.trainer.sharding`);
        ``shard``: called on the trainable module (LoRA added, reference copied) before the
        optimizer is built, e.g. FSDP2's ``fully_shard``."""
        self.model = model
        self.config = config
        self.sampling = sampling
        self.share = share
        self.objective = get_objective(config.objective)(config, sampling)
        self.module = model.trainable_module()
        self.reference = None
        if config.finetune == "lora":
            add_lora(self.module, config)
        elif config.kl_coef > 0:
            self.reference = copy.copy(model)
            self.reference.transformer = copy.deepcopy(self.module).requires_grad_(False).eval()
        if shard is not None:
            shard(self.module)
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        low_precision = sorted({str(p.dtype) for p in trainable if p.dtype != torch.float32})
        if low_precision:
            logger.warning("training %s weights with AdamW: steps below their resolution round away; use "
                           "actor.finetune=lora (float32 adapters) or model.dtype=float32", "/".join(low_precision))
        self.ema = None
        if config.ema_decay is not None:
            self.ema = {name: p.detach().clone() for name, p in self.module.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config, total_optimizer_steps))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint must hold (all of them, or the LoRA adapters); this rank's
        shards when the module is sharded (`full_state` gathers them)."""
        return {k: v for k, v in self.module.state_dict().items() if self.config.finetune == "full" or "lora_" in k}

    def full_state(self, keep: bool = True, gather: bool = True) -> dict | None:
        """Trainable weights, optimizer, schedule and EMA, unsharded and keyed by name (a
        collective when sharded; None where not ``keep``): what a checkpoint holds, loadable on
        any number of ranks. Without ``gather`` only the schedule and EMA (weights and optimizer
        None, for a checkpoint whose ranks write their shards: `save_shards`)."""
        state = {"model": None, "optimizer": None} if not gather else gather_train_state(
            self.module, self.optimizer, set(self.trainable_state()), self.share, keep)
        if state is not None:
            state["scheduler"] = self.scheduler.state_dict()
            state["ema"] = None if self.ema is None else {k: v.detach().cpu() for k, v in self.ema.items()}
        return state

    def save_shards(self, folder: str) -> dict:
        """Write this rank's shards of the trainable weights and optimizer state into ``folder``
        (torch.distributed.checkpoint; a collective). Returns this rank's non-finite weights:
        when any rank has one, nothing is written."""
        return save_shards(self.module, self.optimizer, set(self.trainable_state()), folder)

    def load_full_state(self, state: dict) -> None:
        """Load `full_state`'s result (saved by any number of ranks), or, when ``state["shards"]``
        names a `save_shards` folder, this rank's part of it (saved by any number of ranks; a
        collective). ``state["changes"]``: resumed settings to put into the optimizer and schedule
        (`apply_to_train_state`)."""
        if state.get("shards") is not None:
            model, optim = read_shards(self.module, self.optimizer, set(self.trainable_state()), state["shards"])
            state = {**state, "model": model, "optimizer": optim, "full": False}
        apply_to_train_state(state, state.get("changes") or {})
        load_train_state(self.module, self.optimizer, state, self.share)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            if state.get("ema") is None:
                raise ValueError("the checkpoint has no EMA weights but actor.ema_decay is set; unset it to resume")
            device = next(self.module.parameters()).device
            self.ema = {k: v.to(device) for k, v in state["ema"].items()}

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

    # -- update -------------------------------------------------------------------------
    def update(self, batch: Batch, advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """One RL update on ``batch`` (rows with the objective's rollout columns), ``advantages`` ``[B]``."""
        cfg = self.config
        objective = self.objective
        device = next(self.module.parameters()).device
        micro_per_mini = cfg.mini_batch_size // cfg.micro_batch_size
        keys = [*objective.rollout_keys, *(k for k in batch.keys() if is_embedding_key(k))]
        advantages = advantages.to(device)
        self.module.eval()  # no dropout: replay must see the function the rollout sampled
        # 1. The rollout's columns on the device, the objective's draws, the epochs' row orders.
        tensors = {k: batch[k].to(device) for k in keys}
        terms = objective.prepare(tensors, generator)
        orders = [torch.randperm(len(batch), generator=generator).to(device) for _ in range(cfg.inner_epochs)]
        # 2. The sampling weights' values for the rows the first optimizer step does not see.
        store = None
        if objective.needs_sampling_values:
            store = _SamplingValues(len(batch), terms)
            # Several ranks keep only their own rows' values from the first mini-batch; a later
            # epoch may hand those rows to another rank, so then every row is passed.
            first = 0 if self.share.distributed and cfg.inner_epochs > 1 else cfg.mini_batch_size
            self._sampling_weights_pass(tensors, orders[0][first:], terms, store)
        # 3. Micro-batches, terms, gradient accumulation, one optimizer step per mini-batch.
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        grad_norms, stepped, finite = [], 0, True
        for order in orders:
            micro_batches = order.split(cfg.micro_batch_size)
            for m, all_rows in enumerate(micro_batches):
                rows_idx = self.share.rows(all_rows)  # this rank's part of the micro-batch
                share = self.share.loss_scale(len(rows_idx), len(all_rows))
                if len(rows_idx) == 0:  # fewer rows than ranks: one row at weight 0 keeps FSDP's collectives matched
                    rows_idx, share = all_rows[-1:], 0.0
                rows = {k: v[rows_idx] for k, v in tensors.items()}
                adv = advantages[rows_idx]
                fresh = stepped == 0  # no optimizer step yet: the weights are those of the rollout
                for j in range(terms):
                    out = objective.forward(self, rows, j)
                    old = None if store is None else store.value(rows_idx, j, objective.sampling_value(out), fresh)
                    loss, diag, kl = objective.loss(self, rows, adv, j, out, old, fresh)
                    if kl is not None:
                        loss = loss + cfg.kl_coef * kl
                        diag = {**diag, "kl_loss": kl.detach()}
                    (loss * share / (terms * micro_per_mini)).backward()
                    finite = finite and bool(torch.isfinite(loss.detach()))
                    _accumulate(sums, counts, {"policy_loss": loss.detach(), **diag}, share / self.share.world_size)
                if (m + 1) % micro_per_mini == 0 or m == len(micro_batches) - 1:
                    norm, took = self._optimizer_step(finite)
                    grad_norms.append(norm)
                    stepped += took
                    finite = True
        sums = self.share.all_reduce_sums(sums)
        metrics = {f"actor/{k}": sums[k] / counts[k] for k in sums}
        metrics["actor/grad_norm"] = float(torch.stack(grad_norms).mean())
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/optimizer_steps"] = stepped
        if stepped < len(grad_norms):
            metrics["actor/skipped_nonfinite"] = len(grad_norms) - stepped
        metrics.update(self._reduced(objective.metrics()))
        return metrics

    def _reduced(self, metrics: dict[str, float]) -> dict[str, float]:
        """An objective's own metrics over the ranks: the largest ``.../max``, the mean of the
        rest (each rank's part of the batch is the same size up to one row)."""
        if not self.share.distributed:
            return metrics
        means = self.share.all_reduce_sums({k: v for k, v in metrics.items() if not k.endswith("/max")})
        out = {k: v / self.share.world_size for k, v in means.items()}
        out.update({k: self.share.all_reduce_max(v) for k, v in sorted(metrics.items()) if k.endswith("/max")})
        return out

    def _optimizer_step(self, loss_finite: bool) -> tuple[torch.Tensor, bool]:
        """Clip and step, then the EMA and the lr schedule; the gradient norm and whether it
        stepped. With a non-finite loss or norm nothing changes but the gradients, cleared: the
        weights, AdamW's moments and step count, the EMA and the schedule stay as they were."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = full_value(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        loss_finite = self.share.all_reduce_max(0.0 if loss_finite else 1.0) == 0.0  # every rank skips, or none
        took = loss_finite and bool(torch.isfinite(norm))
        if took:
            self.optimizer.step()
            if self.ema is not None:
                with torch.no_grad():
                    for name, p in self.module.named_parameters():
                        if name in self.ema:
                            self.ema[name].lerp_(p, 1.0 - self.config.ema_decay)
            self.scheduler.step()
        else:
            logger.warning("non-finite %s: optimizer step skipped", "gradient norm" if loss_finite else "loss")
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach().cpu(), took

    @torch.no_grad()
    def _sampling_weights_pass(self, tensors: dict[str, torch.Tensor], rows: torch.Tensor, terms: int,
                               store: "_SamplingValues") -> None:
        """Fill ``store`` with what the loss compares against, computed with the weights that
        sampled, before any optimizer step of this update, for ``rows`` only.

        Why only some rows: the rows trained before the first optimizer step see those weights in
        their own training forward, which `_SamplingValues.value` detaches and keeps instead of
        running a second, no-grad forward. With ``mini_batch_size`` >= the batch (one optimizer
        step per update) this pass runs on no row at all.

        Several ranks with one epoch: each rank needs only its own part of each later micro-batch
        (the split the training loop makes), so it passes only that; with more epochs a row may
        move to another rank, so every rank passes every row."""
        own_rows = self.share.distributed and self.config.inner_epochs == 1
        for idx in rows.split(self.config.micro_batch_size) if len(rows) else ():
            if own_rows:  # a rank with no row of its own passes one, so FSDP's gathers stay matched
                idx = self.share.rows(idx) if len(self.share.rows(idx)) else idx[-1:]
            part = {key: value[idx] for key, value in tensors.items()}
            for j in range(terms):
                store.value(idx, j, self.objective.sampling_value(self.objective.forward(self, part, j)), fresh=True)


class _SamplingValues:
    """The sampling weights' value (old log-prob, old velocity) of every row and term of one
    update, ``[B, terms, ...]``, allocated at the first value (NaN until filled)."""

    def __init__(self, rows: int, terms: int):
        self.rows, self.terms = rows, terms
        self.values: torch.Tensor | None = None

    def value(self, rows_idx: torch.Tensor, j: int, current: torch.Tensor, fresh: bool) -> torch.Tensor:
        """The rows' sampling-weights value at term ``j``: while no optimizer step has been made
        (``fresh``) that is ``current`` itself, detached and kept for later epochs; afterwards
        the kept one."""
        if self.values is None:
            self.values = torch.full((self.rows, self.terms, *current.shape[1:]), math.nan,
                                     dtype=current.dtype, device=current.device)
        if fresh:
            self.values[rows_idx, j] = current.detach()
        return self.values[rows_idx, j]


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


def _accumulate(sums: dict, counts: dict, values: dict, weight: float = 1.0) -> None:
    """Add ``values`` to the running sums; ``weight`` is this rank's share of the micro-batch
    (1 in one process), so the sums over ranks are the one-process sums."""
    for key, value in values.items():
        sums[key] = sums.get(key, 0.0) + float(value) * weight
        counts[key] = counts.get(key, 0) + 1

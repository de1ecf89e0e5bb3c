"""The `Objective` interface the actor trains through, and the registry that names them.

An objective is what differs between FlowGRPO, DiffusionNFT and their relatives: which rollout
columns it reads, what it draws once per update, how many loss terms a row gives, the value it
compares against with the weights that sampled (old log-prob, old velocity), and the loss of one
term. The `flowloop.trainer.actor.Actor` owns everything else (micro/mini-batches, epochs,
gradient accumulation, clipping, the non-finite skip, EMA, the lr schedule) and finds the
objective by ``actor.objective`` here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

Rows = dict[str, torch.Tensor]
"""A micro-batch: every rollout column the objective asked for (and its per-update draws), row-sliced."""


class Policy(Protocol):
    """What an objective may ask of the actor: the guided velocity with the current weights or
    the frozen reference's (``reference=True``; LoRA: the adapters switched off)."""

    def velocity(self, rows: Rows, x: torch.Tensor, t: torch.Tensor, reference: bool = False) -> torch.Tensor: ...


class Objective(Protocol):
    """One training objective; built as ``cls(actor_config, sampling_params)`` once per actor.

    Per update the actor calls `prepare` once, then for each micro-batch and term ``j``:
    ``out = forward(...)``; ``old`` = `sampling_value` of the same term with the weights that
    sampled (or None when `needs_sampling_values` is False); ``loss(...)``; after the update
    `metrics`.
    """

    rollout_keys: tuple[str, ...]
    """Batch columns the update reads besides the prompt embeddings (e.g. ``all_latents``)."""
    needs_sampling_values: bool
    """Whether `loss` compares against `sampling_value` with the sampling weights. The actor then
    keeps them: the rows trained before the first optimizer step give their own (detached), the
    others come from one no-grad pass at the start of the update."""

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """Raise ValueError (naming the full key) when the `TrainConfig` ``cfg`` cannot train this
        objective: e.g. a sampler that records no log-probs for a policy gradient."""

    def prepare(self, tensors: Rows, generator: torch.Generator) -> int:
        """Add the update's draws to ``tensors`` (the whole batch, on the device) using
        ``generator``; reset per-update diagnostics; return the number of terms per row."""

    def forward(self, policy: Policy, rows: Rows, j: int) -> Any:
        """Term ``j`` with the current weights (carries the gradient when grad is enabled)."""

    def sampling_value(self, out: Any) -> torch.Tensor:
        """The ``[b, ...]`` value of `forward`'s output that the loss compares against."""

    def loss(self, policy: Policy, rows: Rows, advantages: torch.Tensor, j: int, out: Any,
             old: torch.Tensor | None, fresh: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """The scalar loss of term ``j``, its detached diagnostics, and the KL to the reference
        (None without one; the actor adds ``kl_coef`` times it). ``old``: the sampling weights'
        values for these rows. ``fresh``: no optimizer step has been made yet in this update."""

    def metrics(self) -> dict[str, float]:
        """Update-level metrics beyond the per-term diagnostics (full names)."""


_OBJECTIVES: dict[str, type] = {}


def register_objective(name: str, cls: type) -> type:
    """Make ``cls`` trainable as ``actor.objective=<name>``; returns ``cls``."""
    if name in _OBJECTIVES and _OBJECTIVES[name] is not cls:
        raise ValueError(f"objective {name!r} is already registered to {_OBJECTIVES[name].__qualname__}")
    _OBJECTIVES[name] = cls
    return cls


def get_objective(name: str) -> type:
    """The class registered as ``name``."""
    if name not in _OBJECTIVES:
        raise ValueError(f"actor.objective must be one of {objective_names()}, got {name!r}")
    return _OBJECTIVES[name]


def objective_names() -> list[str]:
    return sorted(_OBJECTIVES)

"""The task interface: which prompts train, which validate, and what a validation sample is worth.

The RL recipe knows no task by name. It asks the task for each step's training rows and for the
validation rows, samples them, and hands the images back to `Task.evaluate`, which returns the
metrics to log and the grid to save. A row is a dict with ``raw_prompt`` (the text the model
sees) and any other fields the task wants carried through the rollout to the reward (a shapes
prompt's ``category``, a prompt file's own fields).

A new task is one file: a class with these methods, registered by name with `register_task`,
then chosen with ``data.task=<name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class Grid:
    """Validation samples to show: ``images`` uint8 ``[N, H, W, 3]`` laid out ``per_row`` to a
    row, each row labelled with the caption of its first image."""

    images: np.ndarray
    captions: list[str]
    per_row: int


@runtime_checkable
class Task(Protocol):
    """What the recipe, `flowloop eval` and the tests may ask of a task."""

    val_metric: str
    """The headline validation figure (a key of `evaluate`'s metrics) for the progress line and summary."""

    def train_rows(self, seed: int, step: int, count: int) -> list[dict]:
        """``count`` training rows for ``step``, a function of ``(seed, step)`` alone, so a
        resumed run draws exactly what an uninterrupted one would."""

    def val_rows(self) -> list[dict]:
        """The validation rows, the same on every call (sampled at fixed seeds, so a change in
        the metrics is a change in the weights)."""

    def evaluate(self, images: np.ndarray, rows: list[dict]) -> tuple[dict[str, float], Grid]:
        """Metrics (keys ``val/...``) and the grid for the samples of ``rows``.

        ``images``: uint8 ``[N, H, W, 3]``, a video's first frame. ``rows``: the rows sampled,
        each with ``reward`` (float, NaN where scoring failed) and ``reward_extra`` (the reward's
        extra info for that sample) when the run scored it with its reward.
        """


TaskFactory = Callable[[Any], Task]
"""Builds a task from the run's `TrainConfig` (reads ``cfg.data`` and what else it documents)."""

_TASKS: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: make ``factory(cfg) -> Task`` available as ``data.task=<name>``."""

    def decorator(factory: TaskFactory) -> TaskFactory:
        if name in _TASKS and _TASKS[name] is not factory:
            raise ValueError(f"task {name!r} is already registered; pick another name")
        _TASKS[name] = factory
        return factory

    return decorator


def registered_tasks() -> list[str]:
    return sorted(_TASKS)


def task_name(cfg) -> str:
    """``data.task``, or when it is unset: ``prompt_file`` with a ``data.prompt_file``, else ``shapes``."""
    if cfg.data.task is not None:
        return cfg.data.task
    return "prompt_file" if cfg.data.prompt_file is not None else "shapes"


def build_task(cfg) -> Task:
    """The task the run's config names; an unknown name lists the registered ones."""
    name = task_name(cfg)
    if name not in _TASKS:
        raise ValueError(f"data.task must be one of {registered_tasks()}, got {name!r}")
    return _TASKS[name](cfg)


def draw_uniform(rows: list[dict], rng: np.random.Generator, count: int) -> list[dict]:
    """``count`` rows drawn uniformly, without replacement while the pool allows it."""
    return [rows[i] for i in rng.choice(len(rows), count, replace=count > len(rows))]


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator every task draws a step's training rows from."""
    return np.random.default_rng([seed, step])


def reward_extra_means(rows: list[dict]) -> dict[str, float]:
    """``reward/<key>``: the mean of each numeric field of the rows' ``reward_extra`` (bools
    count 0/1, None is left out); a key already starting with ``reward/`` keeps its name.
    Non-numeric fields (strings, dicts, errors) are skipped."""
    keys = dict.fromkeys(k for row in rows for k in row.get("reward_extra", {}))
    means = {}
    for key in keys:
        values = [v for row in rows if (v := row.get("reward_extra", {}).get(key)) is not None]
        if values and all(isinstance(v, (bool, int, float, np.bool_, np.number)) for v in values):
            means[key if key.startswith("reward/") else f"reward/{key}"] = float(np.mean([float(v) for v in values]))
    return means

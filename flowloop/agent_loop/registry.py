"""Agent loops by name: ``@register_agent_loop("single_turn")`` inside flowloop, or a YAML file
for loops defined anywhere else (``rollout.agent.agent_loop_config_path``):

    - name: retry_until_correct
      _target_: examples.agent_loops.retry.RetryUntilCorrectAgentLoop
      max_attempts: 3              # any further keys are constructor arguments

A row picks its loop with its ``agent_name`` column (else ``agent.default_agent_loop``); the
worker builds a new loop per row, ``instantiate(entry, client=..., tokenizer=...)`` as Hydra would.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

_AGENT_LOOPS: dict[str, dict[str, Any]] = {}
"""name -> Hydra config: ``{"_target_": "module.Class", **constructor kwargs}``."""
_FACTORIES: dict[str, Any] = {}
"""name -> what builds one loop from its dependencies (`instantiate_agent_loop`)."""


def register_agent_loop(name: str):
    """Class decorator: register ``cls`` as the agent loop ``name``."""

    def decorator(cls):
        _register(name, {"_target_": f"{cls.__module__}.{cls.__qualname__}"}, source=cls.__module__)
        return cls

    return decorator


def load_agent_loop_configs(path: str | Path) -> list[str]:
    """Register every entry of a YAML list of ``{name, _target_, ...}``; returns the names.

    Loading the same file twice is harmless; a name already registered to something else is
    a ValueError naming both.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rollout.agent.agent_loop_config_path={str(path)!r} does not exist")
    entries = OmegaConf.load(path)
    if not isinstance(entries, ListConfig):
        raise ValueError(f"{path} must hold a YAML list of {{name, _target_, ...}} entries")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, DictConfig) or "name" not in entry or "_target_" not in entry:
            raise ValueError(f"{path}: entry {i} needs 'name' and '_target_', got {OmegaConf.to_container(entry)}")
        config = OmegaConf.to_container(entry, resolve=True)
        name = config.pop("name")
        _register(name, config, source=str(path))
        names.append(name)
    return names


def agent_loop_config(name: str) -> dict[str, Any]:
    """The Hydra config of loop ``name``; an unknown name lists the registered ones."""
    if name not in _AGENT_LOOPS:
        raise ValueError(
            f"unknown agent loop {name!r}; registered agent loops: {registered_agent_loops()}. "
            "Register one with @register_agent_loop or a YAML file in rollout.agent.agent_loop_config_path."
        )
    return _AGENT_LOOPS[name]


def instantiate_agent_loop(name: str, **dependencies: Any):
    """A new loop ``name``, built with its YAML kwargs plus ``dependencies`` (client, tokenizer).

    A config of plain keyword arguments becomes the class with them bound, once per name (a row
    then costs a constructor call, not ~1 ms of Hydra); one that nests other ``_target_`` objects
    or uses Hydra's other ``_keys_`` goes through Hydra for every row, so no row shares a nested
    object with another."""
    if name not in _FACTORIES:
        _FACTORIES[name] = _factory(agent_loop_config(name))
    return _FACTORIES[name](**dependencies)


def _factory(config: dict[str, Any]):
    kwargs = {key: value for key, value in config.items() if key != "_target_"}
    if any(key.startswith("_") for key in kwargs) or any(_holds_target(value) for value in kwargs.values()):
        return functools.partial(hydra.utils.instantiate, config)
    return functools.partial(hydra.utils.get_object(config["_target_"]), **kwargs)


def _holds_target(value) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(_holds_target(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_target(v) for v in value)


def registered_agent_loops() -> list[str]:
    return sorted(_AGENT_LOOPS)


def _register(name: str, config: dict[str, Any], source: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an agent loop name must be a non-empty string, got {name!r} (from {source})")
    existing = _AGENT_LOOPS.get(name)
    if existing is not None and existing != config:
        raise ValueError(f"agent loop {name!r} from {source} is already registered as {existing}; pick another name")
    _AGENT_LOOPS[name] = config

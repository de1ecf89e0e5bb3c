"""Typed configuration: dataclass schemas, YAML files and ``key=value`` overrides, validated once.

Every run's settings are a dataclass (the schema, with each field documented where it is
defined). YAML files and command-line overrides are merged onto it through OmegaConf, and any
mistake comes back as one ``ValueError`` that names the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

T = TypeVar("T")

RECIPES = Path(__file__).resolve().parent / "recipes"
"""The shipped recipes: one YAML per ready-to-run setup, the defaults users start from."""

DEFAULT_RECIPE = "shapes"
"""The recipe ``flowloop train`` runs with no ``--recipe``/``--config``: DiffusionNFT on the shapes world."""


def recipe_names() -> list[str]:
    """Names of the shipped recipes (``shapes``, ``sd3``, ``flux``...)."""
    return sorted(path.stem for path in RECIPES.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The YAML file of recipe ``name``; an unknown name is a ValueError listing the known ones."""
    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(recipe_names())}")
    return path


def _field_names(schema) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def load_config(schema: type[T], overrides: list[str] = (), yaml_files: list[str | Path] = ()) -> T:
    """Build a ``schema`` instance from its defaults, then ``yaml_files``, then ``key=value`` overrides."""
    cfg = OmegaConf.structured(schema)
    try:
        for path in yaml_files:
            if not Path(path).is_file():
                raise ValueError(f"config file {path} does not exist")
            cfg = OmegaConf.merge(cfg, _load_yaml(path))
        bad = [item for item in overrides if "=" not in item]
        if bad:
            raise ValueError(f"override {bad[0]!r} is not of the form key=value (keys: {', '.join(_field_names(schema))})")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        result = OmegaConf.to_object(cfg)
    except ConfigKeyError as err:
        raise ValueError(f"unknown config key {err.full_key or err.key!r}; known keys: {', '.join(_field_names(schema))}") from None
    except ValidationError as err:
        hint = ""
        if ":" in str(err.full_key).rsplit(".", 1)[-1]:  # `{a:2}` parses as the key "a:2" with no value
            hint = "; in a mapping put a space after each colon, e.g. 'data.category_weights={color_attr: 2}' (quoted for the shell)"
        raise ValueError(f"config key {err.full_key!r}: {err.msg.splitlines()[0]}{hint}") from None
    except OmegaConfBaseException as err:
        raise ValueError(f"bad config: {err}") from None
    check = getattr(result, "validate", None)
    if check is not None:
        check()
    return result


def _load_yaml(path: str | Path):
    """A YAML file as an OmegaConf mapping; malformed YAML is a ValueError naming the file and line."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"config file {path} is not valid YAML ({problem} at{where or ' an unknown place'}); fix that line") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"config file {path} must hold a mapping of keys (e.g. 'actor: {{lr: 1e-5}}'), got a {type(loaded).__name__}")
    return loaded


def to_yaml(config) -> str:
    """The resolved config as YAML, written into every run folder."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))

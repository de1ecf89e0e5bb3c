"""Reward functions, registered by name and chosen in config (``reward.name``, ``reward.kwargs``).

Every reward, once built, is a batched function, sync or async:

    fn(images, prompts, metadata) -> (scores, extra_info)

- ``images``: float tensor ``[B, C, H, W]`` (or ``[B, T, C, H, W]`` for video) in [0, 1];
- ``prompts``: ``B`` prompt strings (the user's text, without chat template);
- ``metadata``: ``B`` dicts, each the row's non-tensor columns (``uid``, ``raw_prompt``, ...);
- ``scores``: ``B`` finite floats; ``extra_info``: ``B`` dicts with the same keys in every row
  (added to the batch as one non-tensor column per key; the trainer logs the mean of each
  numeric one as ``reward/<key>``).

How a reward is named and built (`build_reward`), one rule for all:

- ``name`` is a registered name (``@register_reward("shapes")``) or ``"package.module:attr"``,
  imported on the spot (so a reward can live outside flowloop without registering anything);
- ``kwargs`` (``reward.kwargs`` in config) are the reward's keyword arguments. A reward
  registered with ``factory=True`` is a *factory*: it is called once per `RewardWorker` with the
  kwargs and returns the batched function (load models there, not per call; a class whose
  instances are batched functions is a factory too). Any other reward is the batched function
  itself, and the kwargs are bound to its keyword parameters. Either way an unknown kwarg fails
  at start-up, naming the reward and what it accepts;
- device placement: a reward that holds a model takes a ``device`` kwarg (a torch device
  string, ``"cpu"`` by default), e.g. ``kwargs: {device: "cuda:0"}``.

A function that raises, or returns a non-finite score, fails the rows it was scoring: see
`flowloop.reward.worker.RewardWorker`. A sync function runs in a worker thread, so it must not
rely on thread-local state.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[..., object]

FACTORY_MARK = "__flowloop_reward_factory__"
"""Attribute set on factories by ``register_reward(..., factory=True)``; ``module:attr`` reads it."""

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, factory: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``reward.name = <name>``; ``factory=True`` marks a
    function (or class) that takes the config kwargs and returns the batched function."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REWARDS.get(name)
        if existing is not None and existing is not fn and _qualname(existing) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered to {_qualname(existing)}; pick another name")
        if factory:
            setattr(fn, FACTORY_MARK, True)
        _REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """What ``name`` refers to (a batched function or a factory): a registered reward, or
    ``module:attr`` imported. An unknown name lists the registered ones; a module that cannot be
    imported, or lacks the attribute, is a ValueError saying why."""
    if ":" in name:
        return _import(name)
    if name not in _REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {sorted(_REWARDS)} "
                         "(or give 'package.module:function')")
    return _REWARDS[name]


def build_reward(name: str, kwargs: Mapping[str, Any] | None = None, default_device: str | None = None) -> RewardFn:
    """The batched function of reward ``name`` with ``kwargs`` applied (see the module docstring).

    ``default_device``: given to a reward that takes ``device`` when ``kwargs`` sets none (how
    ``combined`` and ``per_frame`` place the rewards they wrap)."""
    target = get_reward(name)
    kwargs = dict(kwargs or {})
    if default_device is not None and "device" not in kwargs and accepts(target, "device"):
        kwargs["device"] = default_device
    if is_factory(target):
        _check_kwargs(name, target, kwargs, skip=0)
        fn = target(**kwargs)
        if not callable(fn):
            raise ValueError(f"reward factory {name!r} must return a batched function, got {type(fn).__name__}")
        return fn
    if not kwargs:
        return target
    _check_kwargs(name, target, kwargs, skip=3)  # images, prompts, metadata
    return functools.partial(target, **kwargs)


def is_factory(target: RewardFn) -> bool:
    """True for rewards registered with ``factory=True`` and for classes."""
    return inspect.isclass(target) or bool(getattr(target, FACTORY_MARK, False))


def is_async(fn: RewardFn) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def``, a partial of one, or an object
    with an ``async def __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


def accepts(target: RewardFn, parameter: str) -> bool:
    """Whether ``target`` (a factory or batched function) takes keyword ``parameter``."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == parameter or p.kind is p.VAR_KEYWORD for p in params)


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def _import(name: str) -> RewardFn:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {name!r}: a reward path must be 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {type(err).__name__}: {err}") from err
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward {name!r} is a {type(target).__name__}, not a function or factory")
    return target


def _check_kwargs(name: str, target: RewardFn, kwargs: dict, skip: int) -> None:
    """Fail at start-up, not on the first batch, when ``kwargs`` do not fit ``target``."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind(*([None] * skip), **kwargs)
    except TypeError as err:
        accepted = [p.name for p in list(signature.parameters.values())[skip:]
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        raise ValueError(f"reward {name!r}: bad kwargs {sorted(kwargs)} ({err}); it accepts {accepted}") from None


def _qualname(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

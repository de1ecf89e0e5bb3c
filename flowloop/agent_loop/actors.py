"""The seam between local and Ray mode, and all of it: where a worker is created, and how it
is called. Everything else in flowloop holds "handles" and calls them through `call`.

- local: a handle is the object itself; ``call`` awaits its coroutine (all in one event loop);
- ray: a handle is a Ray actor running the same class; ``call`` awaits ``.remote()``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from flowloop.agent_loop.tensor_wire import register as register_tensor_wire
from flowloop.allocator import malloc_env
from flowloop.extras import require

MODES = ("local", "ray")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "ray":
        require("ray", "Ray mode")


def make_actor(cls: type, mode: str, *args: Any, ray_options: dict | None = None, **kwargs: Any):
    """``cls(*args, **kwargs)`` locally; in Ray mode the same class as an (async) Ray actor, with
    ``ray_options`` (resources, placement, restarts) for ``.options``.

    Ray starts workers with one torch thread; actors get the driver's count instead, so a
    sample computed in an actor is the same, bit for bit, as one computed locally, and the
    driver's allocator settings (`flowloop.allocator.malloc_env`), so it runs as fast. Tensors
    travel between the driver and every actor as raw buffers (`flowloop.agent_loop.tensor_wire`).
    """
    check_mode(mode)
    if mode == "local":
        return cls(*args, **kwargs)
    ray = require("ray", "Ray mode")
    threads = str(torch.get_num_threads())
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **malloc_env()}
    register_tensor_wire()  # this process's tensors to the actor; `_wired` does the same in the actor
    options = dict(runtime_env={"env_vars": env}, **(ray_options or {}))
    return ray.remote(_wired(cls)).options(**options).remote(*args, **kwargs)


@functools.cache
def _wired(cls: type) -> type:
    """``cls`` whose instances first set up the tensor wire in their process (Ray offers a
    per-process setup hook for a whole job only, not per actor)."""

    def __init__(self, *args, **kwargs):
        register_tensor_wire()
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


async def call(handle: Any, method: str, *args: Any) -> Any:
    """``await handle.method(*args)`` for a local object or a Ray actor handle."""
    bound = getattr(handle, method)
    remote = getattr(bound, "remote", None)
    result = remote(*args) if remote is not None else bound(*args)
    return await result if inspect.isawaitable(result) else result


def is_remote(handle: Any) -> bool:
    """True for a Ray actor handle."""
    return type(handle).__name__ == "ActorHandle"


async def wait_ready(handles: list) -> None:
    """Wait until every Ray actor has been constructed, so a bad argument fails here, at
    start-up, not on the first batch. Local objects are ready when they exist."""
    remote = [h for h in handles if is_remote(h)]
    for handle in remote:
        await handle.__ray_ready__.remote()

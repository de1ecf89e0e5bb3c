"""Rollout: turn a stream of single-sample requests into batched sampling on a `FlowModel`.

- ``types``: `SamplingParams`, `RolloutRequest`, `DiffusionOutput` (the contract).
- ``engine``: `RolloutEngine`, one synchronous batch on a model; `guided_velocity` for replay.
- ``server``: `RolloutServer`, async intake, dynamic batching, an executor thread, metrics.
- ``client``: `RolloutClient`, least-outstanding routing over replicas (local or Ray actors).
"""

from flowloop.rollout.client import RolloutClient
from flowloop.rollout.engine import AUTO_SHARD_MAX_THREADS, MIN_SHARD_ROWS, RolloutEngine, guided_velocity
from flowloop.rollout.server import RolloutServer
from flowloop.rollout.types import SAMPLERS, DiffusionOutput, RolloutRequest, SamplingParams

__all__ = [
    "AUTO_SHARD_MAX_THREADS",
    "SAMPLERS",
    "DiffusionOutput",
    "MIN_SHARD_ROWS",
    "RolloutClient",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutServer",
    "SamplingParams",
    "guided_velocity",
]

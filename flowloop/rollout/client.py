"""`RolloutClient`: several rollout server replicas behind one `generate`.

Each request goes to the replica with the fewest outstanding requests, counted here, by the
client, so routing needs no round trip and works the same for in-process `RolloutServer`s and for
Ray actor handles (``ray.remote(RolloutServer).remote(engine)``): a replica whose methods have
``.remote`` is called through it and the returned ObjectRef awaited; ray is never imported here.
Ties go round-robin, so sequential callers spread over the replicas too.

A replica that is lost (its Ray actor died) or holds other weights than the request needs (it
was restarted and not yet synced) does not fail the request: it goes to another replica, and
the output's ``metrics["retries"]`` counts the hops.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from flowloop.rollout.types import DiffusionOutput, RolloutRequest, StaleWeightsError

__all__ = ["RolloutClient"]


class RolloutClient:
    """Least-outstanding-requests routing over rollout replicas (local objects or Ray actors)."""

    def __init__(self, replicas: Sequence[Any]):
        if not replicas:
            raise ValueError("RolloutClient needs at least one replica")
        self.replicas = list(replicas)
        self._outstanding = [0] * len(self.replicas)
        self._routed: dict[str, int] = {}
        self._next = 0

    async def generate(self, request: RolloutRequest) -> DiffusionOutput:
        """Send ``request`` to the least-loaded replica and await its `DiffusionOutput`; on a lost
        or stale replica, to the least-loaded of the others (every replica is tried once)."""
        tried: list[int] = []
        while True:
            index = self._pick(exclude=tried)
            self._outstanding[index] += 1
            self._routed[request.request_id] = index
            try:
                output = await _call(self.replicas[index], "generate", request)
            except Exception as err:
                tried.append(index)
                if not replica_unusable(err) or len(tried) == len(self.replicas):
                    raise
                continue
            finally:
                self._outstanding[index] -= 1
                if self._routed.get(request.request_id) == index:
                    del self._routed[request.request_id]
            output.metrics["retries"] = float(len(tried))
            return output

    async def flush(self, request_ids: Sequence[str]) -> None:
        """Tell each replica that these of its requests (routed by this client, still in flight)
        are a complete batch: it runs them without waiting out its ``max_wait_ms``
        (`RolloutServer.flush`). Ids this client did not route, or no longer has, are ignored."""
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._routed.get(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            await _call(self.replicas[index], "flush", ids)

    async def abort(self, request_id: str) -> bool:
        """Abort a request on the replica it was routed to; False if this client has none such."""
        index = self._routed.get(request_id)
        if index is None:
            return False
        return bool(await _call(self.replicas[index], "abort", request_id))

    async def pause(self) -> None:
        """Pause every replica (each returns once its running batch is done): for weight updates."""
        for replica in self.replicas:
            await _call(replica, "pause")

    async def resume(self) -> None:
        for replica in self.replicas:
            await _call(replica, "resume")

    @property
    def outstanding(self) -> list[int]:
        """Requests in flight per replica, as this client counts them."""
        return list(self._outstanding)

    @property
    def num_outstanding(self) -> int:
        return sum(self._outstanding)

    def _pick(self, exclude: Sequence[int] = ()) -> int:
        """Fewest outstanding; among equals, the first at or after the round-robin pointer."""
        n = len(self.replicas)
        order = [i for i in ((self._next + k) % n for k in range(n)) if i not in exclude]
        index = min(order, key=lambda i: self._outstanding[i])
        self._next = (index + 1) % n
        return index


def replica_restarting(err: BaseException) -> bool:
    """A Ray actor that Ray is bringing back (it answers again soon), as opposed to one gone for good."""
    return "ActorUnavailableError" in {cls.__name__ for cls in type(err).__mro__}


def replica_unusable(err: BaseException) -> bool:
    """A dead or restarting Ray actor (matched by name: ray is not imported here), or stale weights."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return isinstance(err, StaleWeightsError) or bool(names & {"RayActorError", "ActorDiedError", "ActorUnavailableError"})


async def _call(replica: Any, method: str, *args: Any) -> Any:
    """``replica.method(*args)``, through ``.remote`` for a Ray actor handle; awaited if awaitable."""
    bound = getattr(replica, method)
    result = bound.remote(*args) if hasattr(bound, "remote") else bound(*args)
    if inspect.isawaitable(result):
        result = await result
    return result

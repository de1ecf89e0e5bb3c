"""`RolloutPipeline`: where a training step's generated and scored rows come from.

    rollouts = RolloutPipeline(manager, make_batch, cfg.rollout.max_staleness)
    out = rollouts.take(step)       # this step's rows: started ahead, or generated now
    rollouts.start(step + 1)        # max_staleness > 0: the next step's rows sample meanwhile
    ...update...
    rollouts.wait()                 # the next step's rows are done; then the weights may change

On-policy (``rollout.max_staleness`` 0) `start` does nothing and `take` generates the step's batch
with the weights of the update just made. In async mode the next step's batch is built (and its
requests name the weight version) when `start` is called, so it samples with the weights the
replicas hold then, one update behind the trainer. Only one batch runs ahead, and nothing of it
is in a checkpoint: a resumed run's first step samples with the restored weights.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from flowloop.protocol import Batch


class RolloutPipeline:
    """Step batches from an `AgentLoopManager`, on-policy or one step ahead."""

    def __init__(self, manager, make_batch: Callable[[int], Batch], max_staleness: int = 0):
        self.manager = manager
        self.make_batch = make_batch
        self.ahead = max_staleness > 0
        self._next: tuple[int, concurrent.futures.Future] | None = None

    def take(self, step: int) -> Batch:
        """Step ``step``'s generated and scored rows (its generation's error, if it failed)."""
        if self._next is not None and self._next[0] == step:
            future = self._next[1]
            self._next = None
            return future.result()
        self.cancel()
        return self.manager.generate_sequences(self.make_batch(step))

    def start(self, step: int) -> None:
        """Async mode: start generating step ``step``'s batch now (nothing on-policy)."""
        if self.ahead:
            self.cancel()
            self._next = (step, self.manager.generate_sequences_future(self.make_batch(step)))

    def wait(self) -> None:
        """Until the batch started ahead has finished (its error, if any, comes with `take`)."""
        if self._next is not None:
            concurrent.futures.wait([self._next[1]])

    def cancel(self) -> None:
        """Drop the batch started ahead, if any (its rows are cancelled)."""
        if self._next is not None:
            self._next[1].cancel()
            self._next = None

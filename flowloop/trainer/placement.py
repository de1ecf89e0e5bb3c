"""`WorkerGroup`: where a run's `ModelWorker`s live, and the few calls the recipe makes on them.

    group = WorkerGroup.create(cfg)             # local: one worker object; ray: actors, placed
    metrics = group.update(batch, adv, gen)     # every trainer rank, the same batch and generator state
    group.sync_weights(manager, version)        # replicas sample update `version`'s weights next
    state = group.checkpoint_state(); group.load_checkpoint_state(state)   # whole, on rank 0
    group.save_shards(folder)                   # or each rank its shards (several ranks)
    group.shutdown()

Ray mode puts the trainer ranks in one placement group (one bundle per rank: a GPU, or a CPU),
so a multi-node cluster packs ranks node by node; disaggregated replicas get their own bundles.
The ranks meet through torch.distributed at rank 0's address (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import nullcontext

import torch

from flowloop.agent_loop.actors import call, make_actor, wait_ready
from flowloop.extras import require
from flowloop.trainer.model_worker import ROLES, ModelWorker


PLACEMENT_TIMEOUT_S = 300.0
"""How long the trainer ranks and replicas may wait for the cluster's devices before the run stops."""

REPLICA_RESTARTS = 3
"""Times Ray restarts a crashed rollout-only replica (disaggregated). While it comes back, its
requests go to the others; it samples again once the next update's weights reach it. Trainer
ranks are not restarted: an FSDP group cannot replace one rank alone."""


class WorkerGroup:
    """The trainer ranks (``actors``) and the rollout replicas (``replicas``; the same handles
    when colocated). Local mode is one colocated worker, or with ``rollout.max_staleness`` > 0 an
    actor and a replica of its own (a second copy of the model), so sampling never sees an update."""

    def __init__(self, actors: list, replicas: list, colocated: bool = True, placement_group=None):
        self.actors = list(actors)
        self.replicas = list(replicas)
        self.colocated = colocated
        self._placement_group = placement_group
        self._loop = asyncio.new_event_loop()

    @classmethod
    def create(cls, cfg, build=None) -> WorkerGroup:
        """The workers ``cfg.scale`` asks for; ``build``: see `ModelWorker` (None loads ``cfg.model.path``)."""
        scale = cfg.scale
        if scale.mode == "local" and cfg.rollout.max_staleness > 0:
            # Sampling ahead, the replica needs its own model: the update must not change it mid-batch.
            return cls([ModelWorker(cfg, ("actor",), build=build)], [ModelWorker(cfg, ("rollout",), build=build)], False)
        if scale.mode == "local":
            # On a GPU the rows' rollout tensors stay there for the update (no round trip through
            # the host); on a CPU they are already where the update reads them.
            worker = ModelWorker(cfg, ROLES, build=build, hold_rows=torch.device(cfg.model.device).type != "cpu")
            return cls([worker], [worker])
        ray = require("ray", "scale.mode=ray")
        if not ray.is_initialized():
            ray.init(address=scale.ray_address, ignore_reinit_error=True, log_to_driver=True)
        gpus = 1 if scale.gpus_per_node else 0
        colocated = scale.placement == "colocated"
        bundles = [{"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1} for _ in range(scale.ranks)]
        if not colocated:
            bundles += [{"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1} for _ in range(scale.replicas)]
        group = ray.util.placement_group(bundles, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise ValueError(f"the Ray cluster cannot place {len(bundles)} bundles of {bundles[0]} within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s (ray status shows what it has); lower scale.world_size / "
                             "scale.gpus_per_node / scale.rollout_replicas or add machines") from None
        roles = ROLES if colocated else ("actor",)
        address = _rendezvous(ray, group, gpus)
        actors = [_remote(group, i, gpus, cfg, roles, i, scale.ranks, address, build, hold_rows=colocated)
                  for i in range(scale.ranks)]
        replicas = actors if colocated else [
            _remote(group, scale.ranks + j, gpus, cfg, ("rollout",), 0, 1, None, build, restarts=REPLICA_RESTARTS)
            for j in range(scale.replicas)]
        made = cls(actors, replicas, colocated, group)
        try:
            made._run(wait_ready(list(dict.fromkeys([*actors, *replicas]))))
        except BaseException:  # a worker failed to start: end the others and free the placement group
            made.shutdown()
            raise
        return made

    # -- calls ----------------------------------------------------------------------------
    def _run(self, coroutine):
        return self._loop.run_until_complete(coroutine)

    def call_all(self, handles: list, method: str, *args) -> list:
        """``handle.method(*args)`` on every handle at once (local objects or Ray actors), in order."""

        async def every():
            return await asyncio.gather(*(call(h, method, *args) for h in handles))

        return self._run(every())

    def describe(self) -> dict:
        """Tokenizer and prompt length, from the first replica (the driver loads no model)."""
        return self.call_all(self.replicas[:1], "describe")[0]

    def update(self, batch, advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """One RL update on every rank; ``generator`` moves on exactly as one process's would.
        The images stay here: the update reads the rollout's tensors, not the pictures."""
        if self.local_worker is None and "responses" in batch:
            batch = batch.select(tensor_keys=[k for k in batch.tensors.keys() if k != "responses"])
        batch, advantages = self._shared(batch), self._shared(advantages)
        results = self.call_all(self.actors, "update", batch, advantages, generator.get_state())
        metrics, state = results[0]
        generator.set_state(state)
        return metrics

    def sync_weights(self, manager, version: int) -> None:
        """After an update: every replica samples with its weights from now on. Colocated, each
        worker copies them in place; disaggregated, rank 0 publishes them once and each replica
        loads them from the object store (a local replica of its own, ``rollout.max_staleness``
        > 0: straight from the actor). Runs on the manager's loop, where the replicas serve."""
        state = None
        if not self.colocated and self.local_worker is not None:
            state = self.call_all(self.actors, "trainable_state", False)[0]
        elif not self.colocated:
            published = self.call_all(self.actors, "publish_weights")
            state = published[0][0]
        manager.update_weights(self.replicas, state, version)

    def checkpoint_state(self, gather: bool = True) -> dict:
        """The trained weights, optimizer state, schedule and EMA, unsharded (a collective), or
        without ``gather`` the schedule and EMA only (from rank 0; `save_shards` writes the rest)."""
        if not gather:
            return self.call_all(self.actors[:1], "checkpoint_state", False)[0]
        return self.call_all(self.actors, "checkpoint_state")[0]

    @property
    def sharded(self) -> bool:
        """Whether the trainer is split over several ranks (then checkpoints are written in shards)."""
        return len(self.actors) > 1

    def save_shards(self, folder) -> list[str]:
        """Every rank writes its shards of the weights and optimizer state into ``folder``
        (torch.distributed.checkpoint; the folder must be reachable from every rank's node).
        Returns the weights that are not finite on some rank (then nothing was written)."""
        results = self.call_all(self.actors, "save_shards", str(folder))
        return sorted({name for bad in results for name in bad})

    def load_checkpoint_state(self, state: dict) -> None:
        self.call_all(self.actors, "load_checkpoint_state", self._shared(state))

    def ema_weights(self):
        """A block in which the replicas sample with the EMA weights (local mode: the actor's own
        module swaps them in; Ray mode offers no EMA, see `TrainConfig.validate`)."""
        local = self.local_worker
        return local.actor.ema_weights() if local is not None else nullcontext()

    def _shared(self, value):
        """In Ray mode, one copy in the object store for every rank (Ray resolves it per call)."""
        if self.local_worker is not None:
            return value
        import ray

        return ray.put(value)

    @property
    def local_worker(self) -> ModelWorker | None:
        """The worker object in local mode (None in Ray mode)."""
        return self.actors[0] if isinstance(self.actors[0], ModelWorker) else None

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        handles = list(dict.fromkeys([*self.actors, *self.replicas]))
        if self.local_worker is None:  # a local worker's server stops with the manager's loop
            import ray

            async def stop_all():
                await asyncio.gather(*(call(h, "stop") for h in handles), return_exceptions=True)

            self._run(stop_all())

            for handle in handles:
                ray.kill(handle)
            if self._placement_group is not None:
                ray.util.remove_placement_group(self._placement_group)
        self._loop.close()


def _remote(group, bundle: int, gpus: int, *args, restarts: int = 0, hold_rows: bool = False):
    """A `ModelWorker` actor on bundle ``bundle`` of the placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
    options = dict(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy, max_concurrency=64, max_restarts=restarts)
    return make_actor(ModelWorker, "ray", *args, ray_options=options, hold_rows=hold_rows)


def _rendezvous(ray, group, gpus: int) -> str:
    """``tcp://ip:port`` on the node of rank 0's bundle, with a port free there."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0)
    def free_address():
        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
    return ray.get(free_address.options(scheduling_strategy=strategy).remote())


"""`ModelWorker`: one process's share of a run, a trainer rank, a rollout replica, or both.

One class serves every placement (`flowloop.config.scale`); its ``roles`` say what it holds:

- ``{"actor", "rollout"}``: colocated. A trainer rank (FSDP2 when there are several) and a rollout
  replica on the same device. With one rank the replica samples with the actor's own module;
  with several, a full copy of the denoiser that `update_weights` refreshes in place after
  every update (the text encoder and VAE are shared).
- ``{"actor"}``: a trainer rank of a disaggregated run; `publish_weights` hands the new weights
  (LoRA: adapters only) to Ray's object store once per update.
- ``{"rollout"}``: a rollout replica of a disaggregated run; `update_weights` loads what the
  trainer published.

The rollout side answers `generate`, `abort`, `pause`, `resume`, `stop` and `metrics` like a
`RolloutServer`, so a `RolloutClient` routes to workers and servers alike. Every method is a
coroutine: locally the group awaits it, in Ray mode the worker is an async actor and compute
runs on the process's compute thread, where the rollout's batches run too.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from flowloop.compute import compute_executor
from flowloop.models import load_flow_model
from flowloop.models.autocast import autocast_forward
from flowloop.models.compiled import bucket_text_lengths, compile_image_decoder, compile_repeated_blocks
from flowloop.protocol import Batch
from flowloop.rollout.engine import RolloutEngine
from flowloop.rollout.server import RolloutServer
from flowloop.rollout.types import SamplingParams
from flowloop.trainer.actor import Actor, optimizer_steps_per_batch
from flowloop.trainer.held_rows import HeldRows
from flowloop.trainer.lora import add_lora
from flowloop.trainer.sharding import RankShare, shard_denoiser

ROLES = ("actor", "rollout")


class ModelWorker:
    """A model in one process, trained (``actor``), sampled (``rollout``), or both."""

    def __init__(self, cfg, roles: tuple[str, ...] = ROLES, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None, build=None, hold_rows: bool = False):
        """``cfg``: the run's `TrainConfig`. ``init_method``: the trainer's process-group rendezvous
        (``tcp://host:port``); None runs without torch.distributed (one rank). ``build``: a
        picklable callable returning the `FlowModel`, run in this process, in place of loading
        ``cfg.model.path`` (models built in memory, e.g. random weights at real size).
        ``hold_rows`` (colocated): training rows' rollout tensors stay here, on the model's device,
        for the update instead of travelling to the driver and back (`HeldRows`)."""
        unknown = set(roles) - set(ROLES)
        if unknown or not roles:
            raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {roles}")
        self.cfg = cfg
        self.roles = tuple(roles)
        self.share = RankShare(rank, world_size)
        self.weight_version = 0
        if init_method is not None:
            # NCCL for the weights on GPUs; gloo for the few CPU tensors the ranks reduce (metrics).
            backend = "cpu:gloo,cuda:nccl" if str(cfg.model.device).startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        if str(cfg.model.device).startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = cfg.model.tf32
        torch.backends.cuda.enable_cudnn_sdp(cfg.model.cudnn_attention)
        # 1. The model, with the trainer's LoRA layout on every copy, so published adapters fit.
        if init_method is not None:
            torch.manual_seed(cfg.trainer.seed)  # LoRA's initial weights: equal on every rank
        self.model = build() if build is not None else load_flow_model(
            cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device, **cfg.model.options)
        if cfg.model.gradient_checkpointing and "actor" in roles:
            self.model.trainable_module().enable_gradient_checkpointing()
        # 2. The actor, and the replica's model: the actor's own module when it is not sharded,
        # else a full copy taken (LoRA added) just before sharding.
        self.actor = None
        self.sampler = self.model
        if "actor" in roles:
            self.actor = self._build_actor(copy_for_rollout="rollout" in roles and self.share.distributed)
            torch.manual_seed(cfg.trainer.seed)  # the run's global RNG stream starts here, the same on every run
        elif cfg.actor.finetune == "lora":
            add_lora(self.model.trainable_module(), cfg.actor)
        if cfg.model.autocast:  # after LoRA: the adapters it is for are in place
            for module in dict.fromkeys(m.trainable_module() for m in (self.model, self.sampler)):
                autocast_forward(module, cfg.model.dtype)
        if cfg.model.compile:  # after LoRA and sharding: the compiled blocks hold the adapters
            for module in dict.fromkeys(m.trainable_module() for m in (self.model, self.sampler)):
                compile_repeated_blocks(module, rollout_only=cfg.model.compile == "rollout")
            for model in dict.fromkeys((self.model, self.sampler)):
                bucket_text_lengths(model)
            if "rollout" in roles:
                compile_image_decoder(self.sampler)
        self.server = None
        if "rollout" in roles:
            s = cfg.rollout.server
            engine = RolloutEngine(self.sampler, s.cpu_shards, device_rows=hold_rows)
            self.server = RolloutServer(engine, s.max_batch_size, s.max_wait_ms)
        self.held = None
        if hold_rows:
            self._need("actor", "hold_rows")
            self._need("rollout", "hold_rows")
            length = cfg.rollout.max_sequence_length or self.model.max_sequence_length
            self.held = HeldRows(rank, world_size, length)

    def _build_actor(self, copy_for_rollout: bool) -> Actor:
        cfg = self.cfg
        sampling = SamplingParams.from_dict(cfg.rollout.sampling_dict(validate=False))
        rows = cfg.data.prompts_per_step * cfg.rollout.n
        planned = cfg.trainer.total_steps * optimizer_steps_per_batch(cfg.actor, rows)
        shard = None
        if self.share.distributed:
            def shard(module):
                if copy_for_rollout:
                    self.sampler = copy.copy(self.model)
                    self.sampler.transformer = copy.deepcopy(module).requires_grad_(False)
                shard_denoiser(module, cfg.model.dtype)
        return Actor(self.model, cfg.actor, sampling, total_optimizer_steps=planned, share=self.share, shard=shard)

    # -- description ----------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        """What the driver needs without loading a model itself: the tokenizer and prompt length."""
        return {"tokenizer": self.model.tokenizer, "max_sequence_length": self.model.max_sequence_length,
                "pid": os.getpid(), "roles": self.roles, "rank": self.share.rank}

    # -- training -------------------------------------------------------------------------
    async def update(self, batch: Batch, advantages: torch.Tensor, generator_state: torch.Tensor):
        """One RL update on the whole batch (this rank trains its share of every micro-batch);
        returns the metrics (the same on every rank) and the generator's state afterwards."""
        self._need("actor", "update")

        def run():
            rows = batch if self.held is None else self.held.restore(batch)
            start = time.perf_counter()
            generator = torch.Generator().set_state(generator_state)
            metrics = self.actor.update(rows, advantages, generator)
            metrics["time/update_compute"] = time.perf_counter() - start  # time/update less this: moving the batch
            return metrics, generator.get_state()

        return await _on_compute(run)

    async def trainable_state(self, everywhere: bool = True) -> dict[str, torch.Tensor] | None:
        """The trained weights (all, or LoRA adapters), unsharded: a collective, so call it on
        every rank; only rank 0 gets them unless ``everywhere``."""
        self._need("actor", "trainable_state")
        return await _on_compute(self._gather, everywhere)

    def _gather(self, everywhere: bool) -> dict[str, torch.Tensor] | None:
        if not self.share.distributed:  # where they live: an in-process replica copies them on its device
            return {k: v.detach() for k, v in self.actor.trainable_state().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # LoRA: the frozen base is never gathered, only the adapters.
        options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere,
                                   ignore_frozen_params=self.cfg.actor.finetune == "lora")
        state = get_model_state_dict(self.actor.module, options=options)
        if not everywhere and self.share.rank != 0:
            return None
        keep = self.actor.trainable_state().keys()
        return {k: v for k, v in state.items() if k in keep}

    async def publish_weights(self) -> list | None:
        """Disaggregated: gather the new weights (collective) and put them into Ray's object store
        once; rank 0 returns ``[ObjectRef]`` (in a list, so Ray does not resolve it), others None."""
        import ray

        state = await self.trainable_state(everywhere=False)
        return None if state is None else [ray.put({k: v.cpu() for k, v in state.items()})]

    # -- checkpoints ----------------------------------------------------------------------
    async def checkpoint_state(self, gather: bool = True) -> dict[str, Any] | None:
        """Full (unsharded) model, optimizer and scheduler state, keyed by parameter name, so a
        checkpoint loads on any world size; on rank 0 (None elsewhere). A collective. Without
        ``gather``: the schedule and EMA only, on any one rank (`save_shards` writes the rest)."""
        self._need("actor", "checkpoint_state")
        return await _on_compute(self.actor.full_state, self.share.rank == 0 or not gather, gather)

    async def save_shards(self, folder: str) -> list[str]:
        """Write this rank's shards of the weights and optimizer state into ``folder``
        (`Actor.save_shards`; a collective); returns its non-finite weights (then nothing is written)."""
        self._need("actor", "save_shards")
        return await _on_compute(self.actor.save_shards, folder)

    async def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Load `checkpoint_state`'s result (every rank gets the whole of it), or this rank's part
        of the shards ``state["shards"]`` names (`Actor.load_full_state`; a collective)."""
        self._need("actor", "load_checkpoint_state")
        await _on_compute(self.actor.load_full_state, state)

    # -- rollout --------------------------------------------------------------------------
    async def update_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """Sample with the weights of update ``version`` from now on. ``state`` None: take them from
        this worker's own actor (colocated; a collective when sharded)."""
        self._need("rollout", "update_weights")
        if state is None and self.actor is not None and self.share.distributed:
            state = await self.trainable_state(everywhere=True)
        elif state is None and self.actor is None:
            raise ValueError("a rollout-only worker needs the published weights, got None")
        await self.server.update_weights(state, version)
        self.weight_version = version
        if self.held is not None:
            self.held.drop_older_than(version)

    async def generate(self, request):
        self._need("rollout", "generate")
        output = await self.server.generate(request)
        if self.held is not None and request.sampling_params.logprobs:  # a training row
            output = self.held.keep(output)
        return output

    async def flush(self, request_ids) -> None:
        """Run these queued requests as a batch now (`RolloutServer.flush`)."""
        if self.server is not None:
            await self.server.flush(request_ids)

    async def abort(self, request_id: str) -> bool:
        return self.server.abort(request_id) if self.server is not None else False

    async def pause(self) -> None:
        if self.server is not None:
            await self.server.pause()

    async def resume(self) -> None:
        if self.server is not None:
            self.server.resume()

    async def metrics(self) -> dict[str, float]:
        """The server's metrics, plus ``held_rows``: training rows whose tensors wait here for an update."""
        metrics = self.server.metrics() if self.server is not None else {}
        if self.held is not None:
            metrics["held_rows"] = float(len(self.held))
        return metrics

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _need(self, role: str, method: str) -> None:
        if role not in self.roles:
            raise RuntimeError(f"ModelWorker.{method} needs the {role!r} role; this worker has {self.roles}")


async def _on_compute(fn, *args):
    """Run ``fn`` on the process's compute thread (where rollout batches run too, so the two
    never overlap on one device) and await it."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(compute_executor(), fn, *args)

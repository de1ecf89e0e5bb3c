"""Schema of where a run's processes go: one process (local), or a Ray cluster with a sharded
trainer and several rollout replicas. Read by `flowloop.trainer.placement`.

    local                      one process, one device; the rollout samples with the trainer's own
                               weights (nothing to copy). The default, and what the tests run.
    ray + colocated            ``world_size`` trainer ranks (FSDP2); each also hosts a rollout
                               replica on its own device and loads the new weights in place
                               after every update (verl's hybrid engine).
    ray + disaggregated        ``world_size`` trainer ranks, ``rollout_replicas`` replicas on
                               devices of their own; after every update rank 0 publishes the new
                               weights (LoRA: adapters only) once to Ray's object store and each
                               replica loads them.

One command runs on a laptop (Ray starts a local cluster), on one multi-GPU node and on a
cluster started with ``ray start --head`` / ``ray start --address``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MODES = ("local", "ray")
PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class ScaleConfig:
    mode: str = "local"
    """``local`` (one process, no Ray) or ``ray`` (trainer ranks and rollout replicas as Ray actors)."""
    placement: str = "colocated"
    """``colocated``: rank i hosts rollout replica i on its device. ``disaggregated``: replicas on
    devices of their own (``rollout_replicas`` of them). Only read with ``mode=ray``."""
    world_size: int = 1
    """Trainer ranks on CPUs (gloo). With ``gpus_per_node > 0`` it is ``nnodes * gpus_per_node``
    and must be left at 1 or set to that product."""
    nnodes: int = 1
    """Machines the trainer spreads over (GPU runs)."""
    gpus_per_node: int = 0
    """GPUs per machine the trainer uses, one rank each (NCCL); 0 = CPU ranks."""
    rollout_replicas: int = 1
    """Disaggregated: rollout replicas (one device each). Colocated: one per trainer rank, so
    leave it at 1 or set it to the world size."""
    ray_address: Optional[str] = None
    """Ray cluster to join (``auto``, ``ray://host:10001``); None joins ``RAY_ADDRESS`` if set,
    else starts a local cluster."""

    @property
    def ranks(self) -> int:
        """Trainer ranks: ``nnodes * gpus_per_node`` on GPUs, ``world_size`` on CPUs."""
        return self.nnodes * self.gpus_per_node if self.gpus_per_node else self.world_size

    @property
    def replicas(self) -> int:
        """Rollout replicas: one per rank when colocated."""
        return self.ranks if self.placement == "colocated" else self.rollout_replicas

    def validate(self) -> None:
        """Raise ValueError naming the first bad ``scale.*`` key and the fix."""
        if self.mode not in MODES:
            raise ValueError(f"scale.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"scale.placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        for key in ("world_size", "nnodes", "rollout_replicas"):
            if getattr(self, key) < 1:
                raise ValueError(f"scale.{key} must be >= 1, got {getattr(self, key)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"scale.gpus_per_node must be >= 0 (0 = CPU ranks), got {self.gpus_per_node}")
        if self.gpus_per_node and self.world_size not in (1, self.ranks):
            raise ValueError(f"scale.world_size={self.world_size} disagrees with scale.nnodes x scale.gpus_per_node = "
                             f"{self.ranks}; leave scale.world_size at 1 on GPUs")
        if self.placement == "colocated" and self.rollout_replicas not in (1, self.ranks):
            raise ValueError(f"scale.rollout_replicas={self.rollout_replicas}: colocated placement runs one replica per "
                             f"trainer rank ({self.ranks}); set scale.placement=disaggregated for another count")
        if self.mode == "local" and (self.ranks > 1 or self.rollout_replicas > 1):
            raise ValueError(f"{self.ranks} trainer ranks / {self.rollout_replicas} rollout replicas need scale.mode=ray "
                             "(local mode is one process)")

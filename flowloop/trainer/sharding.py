"""Data-parallel pieces of the trainer: FSDP2 sharding of the denoiser and the reductions that
make N ranks compute the single-process update.

How N ranks reproduce one process: every rank holds the whole RL batch and walks the same
mini- and micro-batches in the same order (one shared generator state); each micro-batch's rows
are split over the ranks (`rank_rows`), each rank scales its loss by its share of the rows
(`RankShare.loss_scale`), and FSDP2 averages the gradients, so the gradient of every optimizer
step is the single-process one up to float summation order. Diagnostics are summed over ranks
with the same weights (`RankShare.all_reduce_sums`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_denoiser(module: torch.nn.Module, compute_dtype: str = "float32") -> None:
    """``fully_shard`` every block of every top-level ``ModuleList`` (the transformer blocks of
    each family), then the whole module, in place. The shards stay float32 (master weights,
    float32 gradient reductions and optimizer state); with a ``compute_dtype`` other than
    float32, forward and backward run in it (FSDP2's ``MixedPrecisionPolicy``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module.float()
    policy = MixedPrecisionPolicy()
    if compute_dtype != "float32":
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=torch.float32)
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)


def rank_rows(rows: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous part of a micro-batch's row indices ``[m]`` (sizes differ by at
    most one; every rank gets a row when ``m >= world_size``)."""
    return rows.tensor_split(world_size)[rank]


@dataclass(frozen=True)
class RankShare:
    """This process's place among the trainer ranks; ``world_size == 1`` is the plain actor."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rank_rows(rows, self.rank, self.world_size) if self.distributed else rows

    def loss_scale(self, mine: int, total: int) -> float:
        """Factor on this rank's mean loss so that FSDP2's gradient average over ranks equals the
        gradient of the mean over all ``total`` rows: ``world_size * mine / total``."""
        return self.world_size * mine / total if self.distributed else 1.0

    def all_reduce_sums(self, values: dict[str, float]) -> dict[str, float]:
        """Sum each value over the ranks (keys must be the same on every rank)."""
        if not self.distributed:
            return values
        keys = sorted(values)
        packed = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(packed)
        return dict(zip(keys, packed.tolist()))

    def all_reduce_max(self, value: float) -> float:
        if not self.distributed:
            return value
        packed = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return float(packed)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a grad norm FSDP2 returns sharded), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gather_train_state(module: torch.nn.Module, optimizer, trainable: set[str], share: RankShare,
                       keep: bool = True) -> dict | None:
    """The whole model (its ``trainable`` names) and optimizer state, unsharded and keyed by
    parameter name, so a checkpoint loads on any number of ranks. A collective when sharded;
    only ranks with ``keep`` get the result (None elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if share.distributed else None
    model = get_model_state_dict(module, options=options)
    optim = get_optimizer_state_dict(module, optimizer, options=options)
    if not keep:
        return None
    return {"model": {k: v.detach().cpu() for k, v in model.items() if k in trainable}, "optimizer": optim}


def save_shards(module, optimizer, trainable: set[str], folder) -> list[str]:
    """Write this rank's shards of the ``trainable`` weights and of the optimizer state into
    ``folder`` with torch.distributed.checkpoint (a collective: every rank calls it with the same
    folder). Frozen weights (a LoRA run's base model) are not written. Returns the names of the
    weights whose local shard is not finite; when any rank has one, no rank writes anything."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(module, optimizer)
    model = {k: v for k, v in model.items() if k in trainable}
    bad = nonfinite(model)
    found = torch.tensor([len(bad)])
    if dist.is_initialized():
        dist.all_reduce(found)
    if int(found) > 0:
        return bad
    dcp.save({"model": model, "optimizer": optim}, checkpoint_id=folder)
    return []


def read_shards(module, optimizer, trainable: set[str], folder) -> tuple[dict, dict]:
    """This process's part of a `save_shards` checkpoint, in the layout of its own ``module``
    (sharded over any number of ranks, or whole): ``(model, optimizer)`` state dicts keyed by
    parameter name, for `load_train_state`. A collective when a process group is up."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(module, optimizer)  # a fresh optimizer gets its state's shape (a zero-lr step)
    model = {k: v for k, v in model.items() if k in trainable}
    state = {"model": model, "optimizer": optim}
    with warnings.catch_warnings():  # without a process group torch warns that it loads in one process: the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder)
    return state["model"], state["optimizer"]


def load_train_state(module: torch.nn.Module, optimizer, state: dict, share: RankShare) -> None:
    """Load `gather_train_state`'s result, whatever the number of ranks that saved it, or (with
    ``state["full"]`` False) `read_shards`' result, already in this rank's layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = share.distributed and state.get("full", True)
    options = StateDictOptions(full_state_dict=full, strict=False)
    known = set(module.state_dict())
    unknown = [k for k in state["model"] if k not in known]
    if unknown:
        raise ValueError(f"checkpoint weights {unknown[:3]} are not in the model; was it saved with other "
                         "actor.finetune / LoRA settings?")
    set_model_state_dict(module, state["model"], options=options)
    set_optimizer_state_dict(module, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True) if full else None)


def nonfinite(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point weights holding a NaN or an infinity (of a DTensor: in
    this rank's shard)."""
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in weights.items()}
    return [k for k, v in local.items() if v.is_floating_point() and not torch.isfinite(v).all()]

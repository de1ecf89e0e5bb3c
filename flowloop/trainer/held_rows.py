"""`HeldRows`: the rollout tensors a colocated worker keeps where it sampled them.

A training row's prompt embeddings and latents (megabytes per row at real sizes) are needed by
the update alone, and with colocated placement (a Ray worker of both roles, or a local run on a
GPU) the update runs in the very process that sampled them. So instead of copying them to the
host and sending them to the agent-loop worker, the driver (through Ray's object store) and
back, the worker keeps them on its device (`RolloutEngine`'s ``device_rows``) and the row
carries a ``held_row`` reference (``"<rank>:<request id>"``); `restore` puts them back into the
batch on every rank (several ranks exchange their rows, through the host, with one collective).
Images still travel: the reward needs them.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from flowloop.agent_loop.worker import stack_extra_tensors
from flowloop.protocol import Batch

HELD_ROW_KEY = "held_row"
"""The non-tensor column naming where a row's rollout tensors are kept."""

TRAVELLING = ("weight_version",)
"""Rollout tensors that still go with the row: small, and the driver reads them."""


class HeldRows:
    """Rollout tensors of this rank's sampled rows, by request id, until an update takes them."""

    def __init__(self, rank: int, world_size: int, max_sequence_length: int):
        self.rank = rank
        self.world_size = world_size
        self.max_sequence_length = max_sequence_length
        self._rows: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()  # `keep` runs on the event loop's thread, `restore` on the compute thread

    def __len__(self) -> int:
        return len(self._rows)

    def keep(self, output):
        """Move ``output``'s extra tensors into the store; the output carries the reference instead."""
        fields = output.extra_fields
        tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor) and k not in TRAVELLING}
        if not tensors:
            return output
        version = int(fields["weight_version"]) if "weight_version" in fields else -1
        with self._lock:
            self._rows[output.request_id] = (version, tensors)
        rest = {k: v for k, v in output.extra_fields.items() if k not in tensors}
        rest[HELD_ROW_KEY] = f"{self.rank}:{output.request_id}"
        output.extra_fields = rest
        return output

    def restore(self, batch: Batch) -> Batch:
        """``batch`` with its held rows' tensors as columns again (a collective with several
        ranks). Those rows leave the store: a row is restored once, and a batch that fails here
        must be sampled again."""
        if HELD_ROW_KEY not in batch:
            return batch
        if any(ref is None for ref in batch[HELD_ROW_KEY]):
            raise ValueError(f"some rows of the batch have no {HELD_ROW_KEY!r}: a batch for the update mixes rows "
                             "sampled by the trainer's own workers with rows from elsewhere")
        refs = [str(ref).split(":", 1) for ref in batch[HELD_ROW_KEY]]
        # A row this rank should hold and does not is reported after the collective, so no rank hangs.
        with self._lock:
            mine = {i: self._rows.pop(request_id, None) for i, (rank, request_id) in enumerate(refs) if int(rank) == self.rank}
        if self.world_size > 1:  # rows cross ranks through the host: a device tensor pickled names this rank's GPU
            mine = {i: None if row is None else (row[0], {k: v.cpu() for k, v in row[1].items()}) for i, row in mine.items()}
        rows = dict(mine)
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
            for part in everyone:
                rows.update(part)
        missing = [i for i in range(len(batch)) if rows.get(i) is None]
        if missing:
            raise RuntimeError(f"{len(missing)} rows of the batch (first: row {missing[0]}, {HELD_ROW_KEY} "
                               f"{batch[HELD_ROW_KEY][missing[0]]!r}) name rollout tensors no rank holds; "
                               "a batch for the update must come from this run's own rollout, in this process's lifetime")
        restored = batch.select(non_tensor_keys=[k for k in batch.non_tensors if k != HELD_ROW_KEY])
        columns = stack_extra_tensors([rows[i][1] for i in range(len(batch))], self.max_sequence_length,
                                      lambda i: f"row {i} ({batch[HELD_ROW_KEY][i]})")
        for key, value in columns.items():
            restored[key] = value
        return restored

    def drop_older_than(self, version: int) -> None:
        """Forget rows sampled with weights older than ``version``: once this replica samples
        with update ``version``, no batch will train the earlier ones (rows the trainer dropped,
        e.g. groups without reward spread, or a whole step with no update)."""
        with self._lock:
            self._rows = {k: v for k, v in self._rows.items() if v[0] >= version}

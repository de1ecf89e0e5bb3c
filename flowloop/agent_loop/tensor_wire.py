"""Torch tensors between Ray processes as raw buffers, not through torch's pickle.

Ray hands NumPy arrays to the object store out of band (pickle protocol 5: the bytes travel as
they are), while a torch tensor goes through torch's own reducer, which copies its storage into
the pickle stream and back. Rows cross processes several times a step in Ray mode (replica ->
agent-loop worker -> reward worker and driver; the batch to the trainer ranks; published weights),
so every flowloop process sends CPU tensors as NumPy buffers instead: `register` runs in the
driver and, through the actors' ``worker_process_setup_hook``, in every actor `make_actor` starts.
`benchmarks/ray_tensors.py` measures both ways side by side.

The receiver gets a contiguous tensor with its own, writable memory and the same bits (bf16
travels as int16). A tensor NumPy cannot hold (on a GPU, needing grad, a dtype NumPy lacks) goes
through ``torch.save`` as before.
"""

from __future__ import annotations

import io

import numpy as np
import torch

_REGISTERED = False


def register() -> None:
    """Send this process's CPU tensors to other Ray processes as buffers (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
    _REGISTERED = True


def to_wire(tensor: torch.Tensor) -> tuple[str, object]:
    if tensor.device.type == "cpu" and not tensor.requires_grad and tensor.layout == torch.strided:
        dense = tensor.detach().resolve_conj().resolve_neg().contiguous()
        try:
            if dense.dtype == torch.bfloat16:
                return "bf16", dense.view(torch.int16).numpy()
            return "numpy", dense.numpy()
        except TypeError:  # a dtype NumPy has no counterpart for
            pass
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return "torch", buffer.getvalue()


def from_wire(wire: tuple[str, object]) -> torch.Tensor:
    kind, data = wire
    if kind == "torch":
        return torch.load(io.BytesIO(data), weights_only=True)
    tensor = torch.from_numpy(np.array(data))  # a copy: the object store's buffer is read-only
    return tensor.view(torch.bfloat16) if kind == "bf16" else tensor

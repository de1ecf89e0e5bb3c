"""Tensors between Ray processes as raw buffers: the same bits, contiguous, writable, and used by
every actor `make_actor` starts."""

import pytest
import ray
import torch

from flowloop.agent_loop.actors import make_actor
from flowloop.agent_loop.tensor_wire import from_wire, to_wire

SAMPLES = {
    "float32": torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0)),
    "bfloat16": torch.randn(4, 5, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "int64 ids": torch.arange(12).reshape(3, 4),
    "bool mask": torch.tensor([True, False, True]),
    "0-dim version": torch.tensor(7),
    "transposed view": torch.arange(6.0).reshape(2, 3).t(),
    "slice of a larger storage": torch.arange(1000.0)[10:20],
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_round_trip_keeps_the_bits_and_gives_own_writable_memory(name):
    tensor = SAMPLES[name]
    kind, _ = wire = to_wire(tensor)
    back = from_wire(wire)
    assert kind in ("numpy", "bf16")
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    assert back.is_contiguous()
    back.zero_()  # its own memory: the sender's tensor (never all zeros here) is untouched
    assert not torch.equal(back, tensor)


def test_a_tensor_needing_grad_goes_through_torch_save():
    tensor = torch.randn(3, requires_grad=True)
    kind, _ = wire = to_wire(tensor)
    back = from_wire(wire)
    assert kind == "torch" and back.requires_grad and torch.equal(back.detach(), tensor.detach())


class Sender:
    async def transposed(self) -> torch.Tensor:
        return torch.arange(6.0).reshape(2, 3).t()

    async def echo_strides(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tensor.stride()


def test_actors_and_driver_send_tensors_as_buffers():
    """torch's own pickle keeps a view's strides; the wire sends it contiguous: so the strides
    show which way a tensor came, both from an actor and to one."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = make_actor(Sender, "ray")
        received = ray.get(actor.transposed.remote())
        assert torch.equal(received, torch.arange(6.0).reshape(2, 3).t()) and received.is_contiguous()
        assert ray.get(actor.echo_strides.remote(torch.arange(6.0).reshape(2, 3).t())) == (2, 1)
    finally:
        ray.shutdown()

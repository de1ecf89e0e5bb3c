"""Tensors from one Ray actor to another: torch's own pickle against flowloop's tensor wire
(`flowloop.agent_loop.tensor_wire`), side by side in one run.

    python benchmarks/ray_tensors.py                      # 16 images of 3x512x512 float32 (3 MB each)
    python benchmarks/ray_tensors.py --shape 333 4096 --dtype bfloat16   # SD3-sized prompt embeddings

A receiving actor awaits ``--count`` tensors from a sending actor at once (what an agent-loop
worker does with a batch's samples); the sender is a plain Ray actor (torch's pickle) or one
started by `make_actor` (the wire). The settings alternate for ``--repeats`` rounds; the figure
is each one's fastest round.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Sender:
    def __init__(self, shape: list[int], dtype: str):
        self.tensor = torch.rand(*shape).to(getattr(torch, dtype))

    async def get(self) -> torch.Tensor:
        return self.tensor.clone()


class Receiver:
    async def pull(self, sender, count: int) -> float:
        start = time.perf_counter()
        tensors = await asyncio.gather(*(sender.get.remote() for _ in range(count)))
        assert len(tensors) == count and isinstance(tensors[0], torch.Tensor)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[3, 512, 512])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import ray

    from flowloop.agent_loop.actors import make_actor

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    senders = {"torch pickle": ray.remote(Sender).remote(args.shape, args.dtype),
               "tensor wire": make_actor(Sender, "ray", args.shape, args.dtype)}
    receiver = ray.remote(Receiver).remote()
    best = {name: float("inf") for name in senders}
    for name, sender in senders.items():  # warm-up
        ray.get(receiver.pull.remote(sender, 2))
    for _ in range(args.repeats):
        for name, sender in senders.items():
            best[name] = min(best[name], ray.get(receiver.pull.remote(sender, args.count)))
    ray.shutdown()
    size = torch.tensor(0, dtype=getattr(torch, args.dtype)).element_size()
    for dim in args.shape:
        size *= dim
    print(f"{args.count} tensors of {args.shape} {args.dtype} ({size / 2**20:.1f} MiB each), one hop, fastest of {args.repeats}:")
    for name, seconds in best.items():
        print(f"  {name:13} {seconds:.3f} s  ({args.count * size / 2**30 / seconds:.2f} GiB/s)")
    print(f"  wire / pickle time: {best['tensor wire'] / best['torch pickle']:.2f}")


if __name__ == "__main__":
    main()

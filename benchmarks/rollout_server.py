"""Rollout server throughput: dynamic batching vs the same requests one at a time.

    .venv/bin/python benchmarks/rollout_server.py [--requests 64] [--max-batch-size 16] [--max-wait-ms 5] [--repeats 3]
                                                  [--device cuda] [--dtype bfloat16]

On the shipped tiny model (`load_flow_model()`, 32x32), 10 steps, sampler sde (Flow-GRPO's,
default window: every step but the last, log-probs on), ``--requests`` single-sample requests
(8 prompts x 8 seeds, as GRPO groups them) run (a) one at a time, ``engine.sample([r])`` each,
and (b) all at once through `RolloutServer` (``asyncio.gather`` of one `generate` per request).
Prints samples/s of each, the speed-up, the server's mean batch size, and
``torch.get_num_threads()``. ``--dtype bfloat16`` runs the DiT in bf16 (the step and log-prob
math stays float32). Each mode runs ``--repeats`` times, interleaved, against one long-lived
server warmed up before timing; the median counts (the machine may be shared). All torch work,
model set-up included, runs on the compute thread (`flowloop.compute`) the server uses, so the
process has one OpenMP team and neither mode is slowed by the other's thread (CPU shard threads,
``--cpu-shards``, run one intra-op thread each and form no team).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import platform
import statistics
import time

import torch

from flowloop.allocator import keep_freed_memory
from flowloop.compute import run_compute
from flowloop.models import load_flow_model
from flowloop.rollout import RolloutEngine, RolloutRequest, RolloutServer, SamplingParams
from flowloop.tasks import shapes


def make_requests(model, n: int, tag: str) -> list[RolloutRequest]:
    prompts = shapes.split_prompts("train")[:8]
    ids, mask = model.tokenize(prompts)
    params = SamplingParams(height=32, width=32, num_inference_steps=10, sampler="sde")
    return [
        RolloutRequest(f"{tag}-{k}", ids[k % 8][mask[k % 8].bool()], dataclasses.replace(params, seed=k))
        for k in range(n)
    ]


def one_at_a_time(engine: RolloutEngine, requests: list[RolloutRequest]) -> float:
    def run() -> float:
        start = time.perf_counter()
        for request in requests:
            engine.sample([request])
        return len(requests) / (time.perf_counter() - start)

    return run_compute(run)


async def through_server(server: RolloutServer, requests: list[RolloutRequest]) -> tuple[float, float]:
    """All ``requests`` at once: samples/s and the mean batch size of this run alone."""
    batches_before = server.metrics()["num_batches"]
    start = time.perf_counter()
    await asyncio.gather(*(server.generate(r) for r in requests))
    elapsed = time.perf_counter() - start
    return len(requests) / elapsed, len(requests) / (server.metrics()["num_batches"] - batches_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model runs (outputs always come back to the CPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights and activations")
    parser.add_argument("--cpu-shards", type=int, default=None,
                        help="RolloutEngine cpu_shards: slices of a batch run side by side (default: one per thread on a CPU with <= 2 threads; 1: off)")
    args = parser.parse_args()

    keep_freed_memory()  # the allocator setting `flowloop` commands run with (flowloop.allocator)

    def setup() -> tuple:
        model = load_flow_model(device=args.device, dtype=getattr(torch, args.dtype))
        engine = RolloutEngine(model, cpu_shards=args.cpu_shards)
        engine.sample(make_requests(model, 16, "warmup"))  # first-call costs out of the way
        engine.sample(make_requests(model, 1, "warmup"))
        return model, engine

    model, engine = run_compute(setup)
    hardware = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"{hardware}, torch {torch.__version__}, torch.get_num_threads()={torch.get_num_threads()}")
    print(f"shipped tiny model ({args.dtype}), 32x32, 10 steps, sde, {args.requests} requests, "
          f"max_batch_size={args.max_batch_size}, max_wait_ms={args.max_wait_ms}, cpu_shards={args.cpu_shards}")

    single, served, batch_sizes = [], [], []

    async def serve_all() -> None:
        # A long-lived server, as in training, warmed up before timing.
        server = RolloutServer(engine, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms)
        await through_server(server, make_requests(model, args.max_batch_size, "warmup-server"))
        for repeat in range(args.repeats):
            single.append(one_at_a_time(engine, make_requests(model, args.requests, f"single{repeat}")))
            rate, mean_batch = await through_server(server, make_requests(model, args.requests, f"server{repeat}"))
            served.append(rate)
            batch_sizes.append(mean_batch)
            print(f"  repeat {repeat}: one at a time {single[-1]:6.1f} samples/s | server {rate:6.1f} samples/s, "
                  f"mean batch {mean_batch:.1f}")
        await server.stop()

    asyncio.run(serve_all())
    one, many = statistics.median(single), statistics.median(served)
    print(f"one at a time (engine.sample([r]) each): {one:6.1f} samples/s  (median of {args.repeats})")
    print(f"through RolloutServer, all concurrent:   {many:6.1f} samples/s  (median of {args.repeats})")
    print(f"speed-up: {many / one:.2f}x   mean batch size: {statistics.median(batch_sizes):.1f}")


if __name__ == "__main__":
    main()

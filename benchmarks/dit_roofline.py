"""How much batching can speed up the shipped tiny DiT on this machine: a roofline check.

    .venv/bin/python benchmarks/dit_roofline.py [--batch 64] [--repeats 20] [--dtype float32]

The rollout server's speed-up over one-at-a-time sampling is bounded by how much faster the DiT
runs per sample in a batch. This prints the DiT's FLOPs per forward (`torch.utils.flop_counter`),
its time and GFLOP/s at batch 1 and at ``--batch``, and two ceilings measured on the same
threads: a large square matmul (the machine's practical peak) and a matmul of the DiT's own
MLP shape at the batched size ([B x tokens, hidden] x [hidden, mlp]; for the shipped model
[B*80, 160] x [160, 640]). The ratio "peak / batch-1 rate" is the most any batching could give
the DiT alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowloop.models import load_flow_model
from flowloop.tasks import shapes
from flowloop.trainer.bench import count_flops


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_flow_model(dtype=dtype)
    dit = model.trainable_module().eval()
    ids, mask = model.tokenize(shapes.split_prompts("train")[:1])
    with torch.no_grad():
        text = model.text_encoder(ids, mask).to(dtype)

    def inputs(b: int):
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(b, 3, 32, 32, generator=gen).to(dtype), torch.full((b,), 0.5),
                text.expand(b, -1, -1).contiguous(), mask.expand(b, -1).contiguous())

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    with torch.no_grad():
        flops = count_flops(lambda: dit(*inputs(1)))
        print(f"DiT forward: {flops / 1e6:.1f} MFLOP per sample (32x32, {text.shape[1]} text tokens)")
        rates = {}
        for b in (1, args.batch):
            x = inputs(b)
            seconds = median_seconds(lambda: dit(*x), args.repeats)
            rates[b] = flops * b / seconds / 1e9
            print(f"  batch {b:3d}: {seconds / b * 1e3:6.2f} ms a sample, {rates[b]:6.1f} GFLOP/s")
        print(f"  batching gain of the DiT alone: {rates[args.batch] / rates[1]:.2f}x")
        tokens = text.shape[1] + (32 // dit.config.patch_size) ** 2  # joint sequence: text, then image patches
        hidden = dit.config.hidden_size
        mlp = int(hidden * dit.config.mlp_ratio)
        rows = args.batch * tokens
        for name, (m, k, n) in {"square matmul 2048^3": (2048, 2048, 2048),
                                f"DiT MLP shape [{rows}, {hidden}] x [{hidden}, {mlp}]": (rows, hidden, mlp)}.items():
            a, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            rate = 2 * m * k * n / median_seconds(lambda: a @ w, args.repeats) / 1e9
            print(f"  {name}: {rate:6.1f} GFLOP/s  ({rate / rates[1]:.2f}x the batch-1 DiT rate)")


if __name__ == "__main__":
    main()

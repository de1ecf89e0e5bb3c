"""Time a family's VAE decode (real size, random weights) three ways, side by side in one run.

    python benchmarks/vae_decode.py --family sd3 --batch 16 --size 512

The rollout decodes every sample once; `flowloop bench` shows that phase next to the denoising
loop. This isolates it: eager (as the adapters run it today), ``channels_last`` memory format
(cuDNN's faster convolution layouts), and ``channels_last`` + ``torch.compile`` of the decoder.
Prints milliseconds per image and each variant's largest difference from eager.
"""

from __future__ import annotations

import argparse
import time

import torch

from real_models import COMPONENTS, REAL, build_component


def timed_ms(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (and compilation)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / repeats, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["sd3", "flux", "qwen_image"], default="sd3")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    vae = build_component(COMPONENTS[args.family]["vae"], REAL[args.family]["vae"], "cuda", torch.bfloat16).eval()
    channels = vae.config.latent_channels if args.family != "qwen_image" else vae.config.z_dim
    side = args.size // 8
    shape = (args.batch, channels, side, side) if args.family != "qwen_image" else (args.batch, channels, 1, side, side)
    latents = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    results = {}
    with torch.no_grad():
        results["eager"] = timed_ms(lambda: vae.decode(latents, return_dict=False)[0], args.repeats)
        if args.family != "qwen_image":  # 3-D convolutions: channels_last_3d, not measured here
            vae.to(memory_format=torch.channels_last)
            results["channels_last"] = timed_ms(lambda: vae.decode(latents, return_dict=False)[0], args.repeats)
        decoder = torch.compile(vae.decoder)
        original = vae.decoder
        vae.decoder = decoder
        results["compiled"] = timed_ms(lambda: vae.decode(latents, return_dict=False)[0], args.repeats)
        vae.decoder = original
    eager = results["eager"][1].float()
    print(f"{torch.cuda.get_device_name()}, {args.family} VAE decode, {args.batch} x {args.size}x{args.size}, bfloat16")
    for name, (ms, out) in results.items():
        gap = (out.float() - eager).abs().max().item()
        print(f"{name:14} {ms:8.1f} ms a batch {ms / args.batch:7.2f} ms an image  max |diff| vs eager {gap:.2e}")


if __name__ == "__main__":
    main()

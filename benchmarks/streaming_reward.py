"""Streaming reward: how much of a slow reward hides behind generation.

    .venv/bin/python benchmarks/streaming_reward.py [--rows 64] [--reward-ms 50] [--steps 10] [--reward-workers 1 4]

A reward that takes ``--reward-ms`` per sample (the shapes verifier plus a sleep, standing in for
a remote or GPU scorer) is registered, then, on the embedded model in local mode:

1. generation alone (reward off): G, the wall time of ``generate_sequences``;
2. the reward alone on those images, one call: R (about rows x reward-ms);
3. streaming (each sample scored as soon as it is generated): T, per number of reward workers.

Without streaming a step costs G + R; the script prints T and the share of R it hid,
``(G + R - T) / R``. Each figure is the median of ``--repeats`` runs after one warm-up, the settings' runs
interleaved so that a busy moment of the machine hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flowloop.agent_loop import AgentLoopManager
from flowloop.config.rollout import RewardConfig, RolloutConfig
from flowloop.models import load_flow_model
from flowloop.protocol import Batch
from flowloop.reward import register_reward
from flowloop.reward.shapes import shapes_reward
from flowloop.tasks import shapes

SLOW_REWARD = "benchmark_slow_shapes"
_DELAY_S = [0.05]


@register_reward(SLOW_REWARD)
def slow_shapes(images, prompts, metadata):
    """The shapes verifier, made to take ``_DELAY_S`` seconds per sample."""
    time.sleep(_DELAY_S[0] * len(prompts))
    return shapes_reward(images, prompts, metadata)


def make_batch(rows: int, group: int) -> Batch:
    prompts = shapes.split_prompts("train", "color_attr")[: rows // group]
    batch = Batch.from_dict(non_tensors={"raw_prompt": prompts, "uid": [str(i) for i in range(len(prompts))]})
    batch = batch.repeat(group)
    batch.meta_info["global_steps"] = 1
    return batch


def run_once(manager: AgentLoopManager, batch: Batch) -> tuple[float, Batch]:
    start = time.perf_counter()
    out = manager.generate_sequences(batch)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--reward-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reward-workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _DELAY_S[0] = args.reward_ms / 1000.0

    model = load_flow_model()
    batch = make_batch(args.rows, args.group)
    print(f"{len(batch)} rows, {args.steps} steps, 32x32, embedded model, local mode; reward {args.reward_ms:g} ms/sample; "
          f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads; median of {args.repeats} runs")

    # 1. One manager per setting: reward off, then streaming with 1..k reward workers.
    settings = {"generate only": RewardConfig(name=None)}
    settings.update({f"streaming, {k} reward worker(s)": RewardConfig(name=SLOW_REWARD, num_workers=k) for k in args.reward_workers})
    managers = {}
    for label, reward in settings.items():
        config = RolloutConfig(reward=reward)
        config.pipeline.num_inference_steps = args.steps
        managers[label] = AgentLoopManager.create(config, model)
        managers[label].generate_sequences(batch)  # warm-up
    # 2. Interleave the settings' runs, so a busy moment of the machine hits them all alike.
    times: dict[str, list[float]] = {label: [] for label in managers}
    reward_times, outputs = [], {}
    for _ in range(args.repeats):
        for label, manager in managers.items():
            elapsed, outputs[label] = run_once(manager, batch)
            times[label].append(elapsed)
        out = outputs["generate only"]
        start = time.perf_counter()
        slow_shapes(out["responses"], list(out["raw_prompt"]), [{}] * len(out))  # the reward alone, one call
        reward_times.append(time.perf_counter() - start)
    for manager in managers.values():
        manager.shutdown()
    # 3. Report.
    generate_s, reward_s = statistics.median(times.pop("generate only")), statistics.median(reward_times)
    print(f"generate only          G = {generate_s:6.2f} s")
    print(f"reward only            R = {reward_s:6.2f} s")
    print(f"sequential         G + R = {generate_s + reward_s:6.2f} s")
    for label, runs in times.items():
        total_s = statistics.median(runs)
        hidden = (generate_s + reward_s - total_s) / reward_s
        wait = statistics.mean(m["reward_time"] for m in outputs[label].meta_info["metrics"])
        print(f"{label}: T = {total_s:6.2f} s  ({total_s / (generate_s + reward_s):.0%} of G + R, T - G = "
              f"{total_s - generate_s:+.2f} s, {hidden:.0%} of R hidden; mean per-row reward wait {wait * 1000:.0f} ms)")


if __name__ == "__main__":
    main()

"""Batches and configs shared by the agent-loop tests."""

from __future__ import annotations

from pathlib import Path

from flowloop.config.rollout import AgentConfig, PipelineConfig, RewardConfig, RolloutConfig, ValKwargs
from flowloop.protocol import Batch

EXAMPLE_YAML = Path(__file__).resolve().parents[2] / "examples" / "agent_loops" / "agent_loops.yaml"
"""The shipped example: a multi-turn loop defined outside flowloop, registered through YAML."""

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "three circles"]

CONTRACT_TENSORS = {
    "prompts", "attention_mask", "responses", "rollout_log_probs", "all_latents", "all_timesteps",
    "all_next_timesteps", "final_latents", "prompt_embeds", "prompt_embeds_mask", "rm_scores",
}
SHAPES_EXTRA_KEYS = ["correct", "constraints", "reward_error"]
CONTRACT_NON_TENSORS = {"raw_prompt", "uid", "__num_turns__", *SHAPES_EXTRA_KEYS}


def prompt_batch(n: int = 4, prompts: list[str] = PROMPTS, **meta_info) -> Batch:
    """``len(prompts) * n`` rows in GRPO groups (``uid`` per prompt), training step 1 by default."""
    meta_info.setdefault("global_steps", 1)
    batch = Batch.from_dict(non_tensors={"raw_prompt": prompts, "uid": [f"p{i}" for i in range(len(prompts))]}, meta_info=meta_info)
    return batch.repeat(n)


def small_config(resolution: int = 16, steps: int = 4, reward: str | None = "shapes", num_workers: int = 1, **fields) -> RolloutConfig:
    """A config for fast tests: few steps in training and validation."""
    return RolloutConfig(
        pipeline=PipelineConfig(height=resolution, width=resolution, num_inference_steps=steps),
        val_kwargs=ValKwargs(pipeline={"num_inference_steps": steps}),
        agent=fields.pop("agent", AgentConfig(num_workers=num_workers)),
        reward=fields.pop("reward_config", RewardConfig(name=reward)),
        **fields,
    )

"""`SingleTurnAgentLoop`: one prompt, one image. The loop every text-to-image RL run uses."""

from __future__ import annotations

import uuid

from flowloop.agent_loop.base import AgentLoopMetrics, AgentLoopOutput, chat_messages, encode_chat, timed_generate
from flowloop.agent_loop.registry import register_agent_loop
from flowloop.rollout.types import RolloutRequest, SamplingParams


@register_agent_loop("single_turn")
class SingleTurnAgentLoop:
    """Chat template -> token ids -> one ``generate`` call -> the image and its trajectory."""

    def __init__(self, client, tokenizer):
        self.client = client
        self.tokenizer = tokenizer

    async def run(self, sampling_params: SamplingParams, *, raw_prompt, negative_prompt=None, **row) -> AgentLoopOutput:
        """``raw_prompt``: a string or chat messages; ``negative_prompt`` (optional column):
        text for true CFG. Other columns are not used."""
        # 1. Tokenise here, on the event-loop thread (fast tokenizers are not thread-safe).
        prompt_ids = encode_chat(self.tokenizer, chat_messages(raw_prompt))  # [L]
        negative_ids = None
        if negative_prompt is not None:
            negative_ids = encode_chat(self.tokenizer, chat_messages(negative_prompt))
        # 2. One rollout request; its seed and settings travel inside it.
        request = RolloutRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            negative_prompt_ids=negative_ids,
        )
        metrics = AgentLoopMetrics()
        output = await timed_generate(self.client, request, metrics)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_diffusion_output=output.diffusion_output,
            response_logprobs=output.log_probs,
            num_turns=2,  # the user's prompt and the generated image
            metrics=metrics,
            extra_fields=dict(output.extra_fields),
        )

"""An agent loop defined outside flowloop, registered through YAML (``agent_loops.yaml``).

`RetryUntilCorrectAgentLoop` is a small multi-turn loop: it asks for an image, checks it with
the shapes verifier, and asks again (a new turn, a new seed) until the image is correct or
``max_attempts`` is reached. The trajectory it returns, the one the trainer learns from, is the
last attempt's; ``attempt_scores`` (a non-tensor column) records how each attempt did.

Use it with ``rollout.agent.agent_loop_config_path=examples/agent_loops/agent_loops.yaml`` and an
``agent_name`` column of ``retry_until_correct`` (or ``rollout.agent.default_agent_loop``), run from the
repository root so that ``examples`` is importable.
"""

from __future__ import annotations

import dataclasses
import uuid

from flowloop.agent_loop import AgentLoopMetrics, AgentLoopOutput, chat_messages, encode_chat, prompt_text, row_seed, timed_generate
from flowloop.rollout.types import RolloutRequest, SamplingParams
from flowloop.tasks import shapes


class RetryUntilCorrectAgentLoop:
    """Generate, verify, retry: up to ``max_attempts`` images, two turns each."""

    def __init__(self, client, tokenizer, max_attempts: int = 3):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.client = client
        self.tokenizer = tokenizer
        self.max_attempts = max_attempts

    async def run(self, sampling_params: SamplingParams, *, raw_prompt, **row) -> AgentLoopOutput:
        prompt_ids = encode_chat(self.tokenizer, chat_messages(raw_prompt))  # [L], on the loop thread
        metrics = AgentLoopMetrics()
        scores: list[float] = []
        for attempt in range(self.max_attempts):
            # Attempt 0 keeps the row's seed, so it is the single-turn sample; later ones derive theirs.
            params = sampling_params
            if attempt > 0 and sampling_params.seed is not None:
                params = dataclasses.replace(sampling_params, seed=row_seed(sampling_params.seed, attempt, 0))
            request = RolloutRequest(request_id=uuid.uuid4().hex, prompt_ids=prompt_ids, sampling_params=params)
            output = await timed_generate(self.client, request, metrics)
            verdict = shapes.verify(output.diffusion_output, prompt_text(raw_prompt))
            scores.append(verdict.score)
            if verdict.correct:
                break
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_diffusion_output=output.diffusion_output,
            response_logprobs=output.log_probs,
            num_turns=2 * len(scores),  # a user turn and an image per attempt
            metrics=metrics,
            extra_fields={**output.extra_fields, "attempt_scores": scores},
        )

"""The agent-loop layer: agent loops per row, workers that run them with streaming rewards, and
the manager that splits a trainer batch over the workers (locally or as Ray actors)."""

from flowloop.agent_loop.base import AgentLoop, AgentLoopMetrics, AgentLoopOutput, chat_messages, encode_chat, prompt_text, timed_generate
from flowloop.agent_loop.manager import AgentLoopManager, apply_failure_policy
from flowloop.agent_loop.registry import (
    agent_loop_config,
    instantiate_agent_loop,
    load_agent_loop_configs,
    register_agent_loop,
    registered_agent_loops,
)
from flowloop.agent_loop.single_turn import SingleTurnAgentLoop
from flowloop.agent_loop.worker import AGENT_NAME_KEY, ROW_INDEX_KEY, VALIDATION_STEP, AgentLoopWorker, row_seed

__all__ = [
    "AGENT_NAME_KEY",
    "ROW_INDEX_KEY",
    "VALIDATION_STEP",
    "AgentLoop",
    "AgentLoopManager",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AgentLoopWorker",
    "SingleTurnAgentLoop",
    "agent_loop_config",
    "apply_failure_policy",
    "chat_messages",
    "encode_chat",
    "instantiate_agent_loop",
    "load_agent_loop_configs",
    "prompt_text",
    "register_agent_loop",
    "registered_agent_loops",
    "row_seed",
    "timed_generate",
]

"""flowloop: online reinforcement learning (FlowGRPO and kin) for flow-matching generators.

Layers, each importing only those below it: protocol, config, models, sampling, rollout,
agent_loop, reward, trainer, tasks; the `flowloop` command lives in `flowloop.cli`.
"""

__version__ = "0.1.0"

"""Training objectives, one file each, registered by name (``actor.objective``).

A new objective is one file with a class that follows `Objective` plus
``register_objective("name", Class)``; its settings with user-facing keys get a section in
`flowloop.config.actor.ActorConfig`.
"""

from flowloop.trainer.objectives.registry import Objective, Policy, get_objective, objective_names, register_objective
from flowloop.trainer.objectives import flow_grpo, nft  # noqa: E402,F401  (registers the built-ins)

__all__ = ["Objective", "Policy", "get_objective", "objective_names", "register_objective"]

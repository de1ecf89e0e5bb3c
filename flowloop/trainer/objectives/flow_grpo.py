"""FlowGRPO: the clipped policy gradient on the log-probs of the SDE window's recorded steps.

For each trained step ``j`` of the window the objective recomputes the velocity at the stored
latent with the current weights, re-runs the same sampler step with ``prev_sample`` = the stored
next latent, and gets that step's log-prob and mean. The velocity comes from
`flowloop.rollout.engine.guided_velocity` (through the actor), the function the rollout sampled
with, so with unchanged weights the replay reproduces the rollout's log-prob; the
``rollout_correction`` metrics measure how closely. Settings: ``actor.flow_grpo``.
"""

from __future__ import annotations

import math

import torch

from flowloop.config.actor import ActorConfig
from flowloop.rollout.types import SamplingParams
from flowloop.sampling import get_step
from flowloop.trainer.losses import flow_grpo_loss, kl_loss
from flowloop.trainer.objectives.registry import Policy, Rows, register_objective


class FlowGRPO:
    """``actor.objective=flow_grpo``; the loss is `flowloop.trainer.losses.flow_grpo_loss`."""

    rollout_keys = ("all_latents", "all_timesteps", "all_next_timesteps", "rollout_log_probs")

    def __init__(self, config: ActorConfig, sampling: SamplingParams):
        self.config = config
        self.settings = config.flow_grpo
        self.sampling = sampling
        self.step_fn = get_step(sampling.sampler)
        self.step_kwargs = {"logprob_mode": sampling.logprob_mode} if sampling.sampler == "cps" else {}
        self.needs_sampling_values = not self.settings.skip_old_logprob
        self._correction: list[torch.Tensor] = []

    @classmethod
    def validate_config(cls, cfg) -> None:
        """A policy gradient needs the log-probs of noisy steps; off-policy rows, the rollout's own."""
        if cfg.rollout.algo.sampler == "ode":
            raise ValueError("rollout.algo.sampler=ode records no log-probs for flow_grpo to learn from; "
                             "use sde, dance or cps, or set actor.objective=nft")
        if cfg.rollout.algo.noise_level == 0:
            raise ValueError("rollout.algo.noise_level=0 samples without noise, so flow_grpo has no log-probs to learn "
                             "from; raise it or set actor.objective=nft")
        if cfg.rollout.max_staleness > 0 and not cfg.actor.flow_grpo.skip_old_logprob:
            raise ValueError("rollout.max_staleness > 0 needs actor.flow_grpo.skip_old_logprob=true: rows sampled with "
                             "older weights must take logp_old from the rollout, not from a replay with the trainer's")
        if cfg.actor.flow_grpo.balance_steps and cfg.rollout.algo.sampler == "cps" \
                and cfg.rollout.algo.logprob_mode != "density":
            raise ValueError("actor.flow_grpo.balance_steps=true weighs steps by their Gaussian log-density's scale; "
                             f"rollout.algo.logprob_mode={cfg.rollout.algo.logprob_mode!r} is not a density: "
                             "set rollout.algo.logprob_mode=density or actor.flow_grpo.balance_steps=false")

    def prepare(self, tensors: Rows, generator: torch.Generator) -> int:
        """Nothing to draw; the first ``ceil(timestep_fraction x window)`` recorded steps train.
        With ``balance_steps`` the rows get their step weights here, once an update."""
        self._correction = []
        terms = max(1, math.ceil(self.settings.timestep_fraction * tensors["rollout_log_probs"].shape[1]))
        if self.settings.balance_steps:
            tensors["step_weights"] = self.step_weights(tensors, terms)  # [B, terms]
        return terms

    def replay(self, policy: Policy, rows: Rows, j: int, reference: bool = False):
        """Re-run step ``j`` of the window for ``rows``; returns the sampler's `StepOutput`."""
        x = rows["all_latents"][:, j]  # [b, C, H, W]
        t, t_next = rows["all_timesteps"][:, j], rows["all_next_timesteps"][:, j]  # [b]
        v = policy.velocity(rows, x, t, reference)
        return self.step_fn(v, t, t_next, x, noise_level=self.sampling.noise_level,
                            prev_sample=rows["all_latents"][:, j + 1], **self.step_kwargs)

    def forward(self, policy: Policy, rows: Rows, j: int):
        return self.replay(policy, rows, j)

    def sampling_value(self, out) -> torch.Tensor:
        return out.log_prob  # [b]

    def loss(self, policy: Policy, rows: Rows, advantages: torch.Tensor, j: int, out, old: torch.Tensor | None,
             fresh: bool):
        """The clipped loss against ``old`` (None: the rollout's own log-probs), and the transition
        KL to the reference at window step ``j``. Before the first optimizer step the replay's
        distance to the rollout's log-prob is kept for ``rollout_correction``."""
        cfg = self.config
        if fresh:
            self._correction.append((out.log_prob.detach() - rows["rollout_log_probs"][:, j]).abs())
        if old is None:
            old = rows["rollout_log_probs"][:, j]
        weights = rows["step_weights"][:, j] if self.settings.balance_steps else None
        loss, diag = flow_grpo_loss(out.log_prob, old, advantages, self.settings.clip_range, cfg.adv_clip_max,
                                    weights)
        diag = {**diag, **per_step_diagnostics(diag, out.log_prob.detach() - old, advantages, j)}
        if cfg.kl_coef == 0:
            return loss, diag, None
        with torch.no_grad():
            ref = self.replay(policy, rows, j, reference=True)
        dt = rows["all_next_timesteps"][:, j] - rows["all_timesteps"][:, j]  # [b]
        kl = kl_loss(out.mean, ref.mean, out.std, dt=dt if self.sampling.sampler == "sde" else None,
                     mode=self.settings.kl_mode)
        return loss, diag, kl.mean()

    def step_weights(self, rows: Rows, terms: int) -> torch.Tensor:
        """``[b, terms]`` ``std / |d mean / d v|`` of the transitions of each row's first ``terms``
        (trained) steps, divided by the row's mean (``actor.flow_grpo.balance_steps``). Every
        sampler's mean is affine in the
        velocity, so ``d mean / d v`` is the mean at ``v = 1`` minus the mean at ``v = 0``; both
        come from the sampler itself, once per distinct ``(t, t_next)`` pair (rows share their
        schedule), on the host. Deterministic steps (std 0) weigh 0."""
        t = rows["all_timesteps"][:, :terms].float()  # [b, terms]
        t_next = rows["all_next_timesteps"][:, :terms].float()
        pairs, index = torch.unique(torch.stack([t, t_next], -1).reshape(-1, 2).cpu(), dim=0, return_inverse=True)
        zero = torch.zeros(len(pairs), 1)  # [pairs, 1]: one latent element a pair

        def step(v):
            return self.step_fn(v, pairs[:, 0], pairs[:, 1], zero, noise_level=self.sampling.noise_level,
                                prev_sample=zero, **self.step_kwargs)

        at_zero, at_one = step(zero), step(zero + 1)
        slope = (at_one.mean - at_zero.mean).abs().reshape(-1)  # [pairs]
        scale = torch.where(slope > 0, at_zero.std.reshape(-1) / slope.clamp_min(1e-30), torch.zeros_like(slope))
        scale = scale[index].reshape(t.shape)  # [b, terms]
        return (scale / scale.mean(dim=1, keepdim=True).clamp_min(1e-30)).to(t.device)

    def metrics(self) -> dict[str, float]:
        """``rollout_correction/mean`` and ``/max``: ``|logp_replay - logp_rollout|`` over every
        term replayed with the sampling weights."""
        if not self._correction:
            return {}
        everything = torch.cat(self._correction)
        return {"rollout_correction/mean": float(everything.mean()), "rollout_correction/max": float(everything.max())}


def per_step_diagnostics(diag: dict[str, torch.Tensor], log_ratio: torch.Tensor, advantages: torch.Tensor,
                         j: int) -> dict[str, torch.Tensor]:
    """Where in the window the update moves the policy: window step ``j``'s own ``clip_frac_step{j}``
    and ``approx_kl_step{j}`` (from the loss's ``diag``), and ``adv_log_ratio_step{j}`` (mean
    advantage x log-ratio: > 0 when the rows the optimizer has already stepped for moved toward
    their better samples)."""
    return {f"clip_frac_step{j}": diag["clip_frac"], f"approx_kl_step{j}": diag["approx_kl"],
            f"adv_log_ratio_step{j}": (advantages * log_ratio).mean()}


register_objective("flow_grpo", FlowGRPO)

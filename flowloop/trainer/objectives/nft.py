"""DiffusionNFT (Zheng et al., 2025): advantage-weighted flow matching on the rollout's clean samples.

Each update draws, per row, ``actor.nft.timesteps`` noise levels ``t`` in ``actor.nft.time_range``
and noises the row's final latent again there (``x_t = (1 - t) x0 + t eps``); each such level is
one term, whose loss (`flowloop.trainer.losses.nft_loss`) compares the current velocity at
``x_t`` with the velocity of the weights that sampled. It needs no log-probs, so any sampler
works, the ODE the evaluation samples with included.
"""

from __future__ import annotations

import torch

from flowloop.config.actor import ActorConfig
from flowloop.rollout.types import SamplingParams
from flowloop.trainer.losses import kl_loss, nft_loss, noised
from flowloop.trainer.objectives.registry import Policy, Rows, register_objective


class DiffusionNFT:
    """``actor.objective=nft``; settings in ``actor.nft``."""

    rollout_keys = ("final_latents",)
    needs_sampling_values = True

    def __init__(self, config: ActorConfig, sampling: SamplingParams):
        self.config = config
        self.settings = config.nft

    @classmethod
    def validate_config(cls, cfg) -> None:
        """The advantage maps to a share in [0, 1] through the clamp, which must be finite."""
        if not 0 < cfg.actor.adv_clip_max < float("inf"):
            raise ValueError(f"actor.objective=nft maps advantages to [0, 1] by actor.adv_clip_max, which must be "
                             f"finite and > 0, got {cfg.actor.adv_clip_max}")

    @torch.no_grad()
    def prepare(self, tensors: Rows, generator: torch.Generator) -> int:
        """Per row and term: a noise level ``nft_t [B, K]`` and the noised clean sample
        ``nft_noisy [B, K, ...]``."""
        sample = tensors["final_latents"]  # [B, ...]
        rows, k = sample.shape[0], self.settings.timesteps
        lo, hi = self.settings.time_range
        t = (lo + (hi - lo) * torch.rand((rows, k), generator=generator)).to(sample.device)  # [B, K]
        noise = torch.randn((rows, k, *sample.shape[1:]), generator=generator).to(sample.device)  # [B, K, ...]
        tensors["nft_t"] = t
        tensors["nft_noisy"] = torch.stack([noised(sample, noise[:, j], t[:, j]) for j in range(k)], dim=1)  # [B, K, ...]
        return k

    def forward(self, policy: Policy, rows: Rows, j: int) -> torch.Tensor:
        return policy.velocity(rows, rows["nft_noisy"][:, j], rows["nft_t"][:, j]).float()  # [b, ...]

    def sampling_value(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def loss(self, policy: Policy, rows: Rows, advantages: torch.Tensor, j: int, out: torch.Tensor,
             old: torch.Tensor | None, fresh: bool):
        """`nft_loss` at the rows' ``j``-th noise level, and the velocity KL to the reference."""
        cfg = self.config
        x, t = rows["nft_noisy"][:, j], rows["nft_t"][:, j]
        loss, diag = nft_loss(out, old, rows["final_latents"], x, t, advantages, self.settings.beta, cfg.adv_clip_max)
        if cfg.kl_coef == 0:
            return loss, diag, None
        with torch.no_grad():
            v_ref = policy.velocity(rows, x, t, reference=True).float()
        return loss, diag, kl_loss(out, v_ref, 1.0, mode="exact").mean()  # mean (v - v_ref)^2 / 2

    def metrics(self) -> dict[str, float]:
        return {}


register_objective("nft", DiffusionNFT)

"""Classifier-free guidance mixing."""

import pytest
import torch

from flowloop.sampling import apply_cfg, needs_uncond


def test_formula():
    v_c = torch.full((2, 3), 3.0)
    v_u = torch.full((2, 3), 1.0)
    assert torch.equal(apply_cfg(v_c, v_u, 4.5), torch.full((2, 3), 10.0))  # 1 + 4.5 * 2


def test_scale_at_most_one_returns_cond_without_uncond():
    v_c = torch.randn(2, 3)
    assert not needs_uncond(1.0) and not needs_uncond(0.0)
    assert needs_uncond(1.01)
    assert apply_cfg(v_c, None, 1.0) is v_c
    assert apply_cfg(v_c, torch.zeros(2, 3), 0.5) is v_c


def test_missing_or_mismatched_uncond():
    with pytest.raises(ValueError, match="v_uncond"):
        apply_cfg(torch.zeros(2, 3), None, 4.0)
    with pytest.raises(ValueError, match="shape"):
        apply_cfg(torch.zeros(2, 3), torch.zeros(2, 4), 4.0)

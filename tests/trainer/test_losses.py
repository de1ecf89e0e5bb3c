"""FlowGRPO loss against a hand-worked batch (clipping on both sides, advantage clamp, gradient),
the KL penalty in both modes against float64 formulas, and the non-finite loss guard."""

import logging
import math

import pytest
import torch

from flowloop.trainer.losses import NonFiniteGuard, NonFiniteLossError, flow_grpo_loss, kl_loss

# clip_range 0.2, adv_clip_max 5. Per row: A, ratio, then the two terms and the larger one.
#   0  A=2   ratio 1.5   -A*r = -3.0   -A*clip = -2.4   -> -2.4  clipped   (A > 0, ratio too high)
#   1  A=2   ratio 0.5   -1.0          -1.6             -> -1.0  unclipped (A > 0, low ratio kept)
#   2  A=-1  ratio 0.5    0.5           0.8             ->  0.8  clipped   (A < 0, ratio too low)
#   3  A=-1  ratio 1.5    1.5           1.2             ->  1.5  unclipped (A < 0, high ratio kept)
#   4  A=10->5   ratio 1.0  -5.0       -5.0             -> -5.0  advantage clamped
#   5  A=-7->-5  ratio 1.1   5.5        5.5             ->  5.5  advantage clamped, ratio inside
# loss = (-2.4 - 1.0 + 0.8 + 1.5 - 5.0 + 5.5) / 6 = -0.6 / 6 = -0.1
ADV = [2.0, 2.0, -1.0, -1.0, 10.0, -7.0]
RATIO = [1.5, 0.5, 0.5, 1.5, 1.0, 1.1]


def _batch():
    old = torch.tensor([-1.0, 0.5, 2.0, -3.0, 0.25, 1.0])
    log_prob = (old + torch.log(torch.tensor(RATIO))).requires_grad_()
    return log_prob, old, torch.tensor(ADV)


def test_loss_clips_both_sides_and_clamps_advantages():
    log_prob, old, adv = _batch()
    loss, diag = flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert diag["ratio_mean"].item() == pytest.approx(6.1 / 6, abs=1e-6)
    assert diag["clip_frac"].item() == pytest.approx(4 / 6)
    assert diag["clip_frac_high"].item() == pytest.approx(2 / 6)
    assert diag["clip_frac_low"].item() == pytest.approx(2 / 6)
    approx_kl = 0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2 + math.log(1.1) ** 2) / 6  # 0.10823...
    assert diag["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-5)
    assert diag["adv_clamped_frac"].item() == pytest.approx(2 / 6)
    assert all(not v.requires_grad for v in diag.values())

    # d loss / d logp = -A * ratio / B where the unclipped term is the larger one, else 0.
    loss.backward()
    expected = torch.tensor([0.0, -2 * 0.5, 0.0, 1 * 1.5, -5 * 1.0, 5 * 1.1]) / 6
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-5, atol=1e-7)


def test_without_clamp_the_large_advantage_counts_fully():
    log_prob, old, adv = _batch()
    loss, diag = flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=math.inf)
    # rows 4 and 5 become -10 * 1.0 and 7 * 1.1 = 7.7: (-2.4 - 1.0 + 0.8 + 1.5 - 10 + 7.7) / 6
    assert loss.item() == pytest.approx(-3.4 / 6, abs=1e-6)
    assert diag["adv_clamped_frac"].item() == 0.0


def test_old_log_prob_and_advantages_get_no_gradient():
    log_prob, old, adv = _batch()
    old.requires_grad_()
    adv.requires_grad_()
    loss, _ = flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=5.0)
    loss.backward()
    assert old.grad is None and adv.grad is None


def test_weights_multiply_each_rows_term():
    log_prob, old, adv = _batch()
    weights = torch.tensor([0.0, 2.0, 1.0, 1.0, 0.5, 1.0])
    loss, _ = flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=5.0, weights=weights)
    # the table's terms: (0 * -2.4 + 2 * -1.0 + 0.8 + 1.5 + 0.5 * -5.0 + 5.5) / 6
    assert loss.item() == pytest.approx(3.3 / 6, abs=1e-6)


def test_loss_rejects_bad_settings():
    log_prob, old, adv = _batch()
    with pytest.raises(ValueError, match="clip_range must be a finite float > 0, got 0"):
        flow_grpo_loss(log_prob, old, adv, clip_range=0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="adv_clip_max"):
        flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=-1.0)
    with pytest.raises(ValueError, match="one shape"):
        flow_grpo_loss(log_prob, old[:3], adv, clip_range=0.2, adv_clip_max=5.0)
    with pytest.raises(ValueError, match=r"weights must have log_prob's shape \(6,\), got \(3,\)"):
        flow_grpo_loss(log_prob, old, adv, clip_range=0.2, adv_clip_max=5.0, weights=torch.ones(3))


def test_kl_by_hand():
    # (mean - ref)^2 = 0.09 everywhere; full std 0.5 at dt = -0.25, so s = 0.5 / sqrt(0.25) = 1.
    mean, ref = torch.full((1, 4), 0.3), torch.zeros(1, 4)
    assert kl_loss(mean, ref, 0.5, dt=-0.25).item() == pytest.approx(0.09 / 2)  # flow_grpo: / (2 s^2)
    assert kl_loss(mean, ref, 0.5, dt=-0.25, mode="exact").item() == pytest.approx(0.09 / 0.5)  # / (2 std^2)
    assert kl_loss(mean, ref, 0.5, dt=None).item() == pytest.approx(0.09 / 0.5)  # cps: std is s


@pytest.mark.parametrize("mode", ["flow_grpo", "exact"])
def test_kl_against_float64_formula(mode):
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, 4, 4, generator=g)
    ref = mean + 0.1 * torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next, a = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.5, 0.2]), 0.7
    s = a * torch.sqrt(sigma / (1 - sigma))  # Flow-GRPO's std_dev_t
    std = (s * torch.sqrt(sigma - sigma_next)).reshape(3, 1, 1, 1)  # what sde_step returns
    got = kl_loss(mean, ref, std, dt=sigma_next - sigma, mode=mode)

    sq = ((mean.double() - ref.double()) ** 2).flatten(1).mean(1)
    if mode == "flow_grpo":
        expected = sq / (2 * s.double() ** 2)
    else:  # the Gaussian KL with equal variances, element by element, averaged
        full = std.double().expand_as(mean)
        normal = torch.distributions.Normal
        expected = torch.distributions.kl_divergence(normal(mean.double(), full), normal(ref.double(), full))
        expected = expected.flatten(1).mean(1)
    assert got.shape == (3,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


def test_kl_gradient_reaches_the_policy_only_and_zero_std_rows_give_zero():
    mean = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    ref = torch.zeros(2, 2, requires_grad=True)
    kl = kl_loss(mean, ref, torch.tensor([1.0, 0.0]), mode="exact")
    assert kl.tolist() == [pytest.approx(2.5 / 2), 0.0]
    kl.sum().backward()
    assert ref.grad is None
    torch.testing.assert_close(mean.grad, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))  # d/dm mean(m^2)/2 = m / 2
    with pytest.raises(ValueError, match=r"kl mode must be one of \('flow_grpo', 'exact'\)"):
        kl_loss(mean, ref, 1.0, mode="k3")


def test_non_finite_guard_counts_and_stops_after_three_updates_in_a_row(caplog):
    """The actor skips the steps; the guard counts updates that had any and stops the run."""
    guard = NonFiniteGuard()
    with caplog.at_level(logging.WARNING, logger="flowloop.trainer.losses"):
        assert guard.record(0, step=1)
        assert not guard.record(1, step=2)
        assert not guard.record(2, step=3)
        assert guard.record(0, step=4)  # resets the run of updates with skipped steps
        assert not guard.record(1, step=5)
        assert not guard.record(1, step=6)
    assert guard.skipped == 5 and guard.consecutive == 2
    assert "step 2" in caplog.text and "skipped" in caplog.text
    with pytest.raises(NonFiniteLossError, match="3 updates in a row"):
        guard.record(1, step=7)

    restored = NonFiniteGuard()
    restored.load_state_dict({"consecutive": 1, "skipped": 9})
    assert not restored.record(1)
    assert restored.skipped == 10

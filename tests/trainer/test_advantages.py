"""Advantage estimators against hand-computed values: grouping by uid, population std, global
std, Dr.GRPO, zero-variance groups, the per-prompt tracker across steps, and bad input."""

import math

import numpy as np
import pytest
import torch

from flowloop.trainer.advantages import ADVANTAGES, PerPromptStatTracker, compute_advantages, register_advantage

# Two groups, interleaved so that grouping must follow the uid, not the position.
# a: rewards {1, 3}     mean 2, population std 1           (unbiased std would be sqrt(2))
# b: rewards {0, 0, 6}  mean 2, population std sqrt(24/3) = sqrt(8)
UIDS = np.array(["a", "b", "a", "b", "b"], dtype=object)
REWARDS = torch.tensor([1.0, 0.0, 3.0, 0.0, 6.0])
EPS = 1e-4


def test_grpo_uses_group_mean_and_population_std():
    adv, stats, keep = compute_advantages("grpo", REWARDS, UIDS)
    s8 = math.sqrt(8.0) + EPS  # 2.8285271...
    expected = [-1 / 1.0001, -2 / s8, 1 / 1.0001, -2 / s8, 4 / s8]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert adv[0].item() == pytest.approx(-0.99990001, abs=1e-7)  # not -0.7071 (the unbiased std)
    assert keep.all()
    assert stats["num_groups"] == 2
    assert stats["zero_std_group_frac"] == 0.0
    assert stats["group_reward_std_mean"] == pytest.approx((1 + math.sqrt(8)) / 2)
    assert stats["kept_frac"] == 1.0


def test_global_std_divides_by_the_batch_std():
    # batch: mean 2, deviations (-1, -2, 1, -2, 4), variance 26/5 = 5.2
    adv, _, _ = compute_advantages("global_std", REWARDS, UIDS)
    scale = math.sqrt(5.2) + EPS  # 2.2804508...
    torch.testing.assert_close(adv, torch.tensor([-1.0, -2.0, 1.0, -2.0, 4.0]) / scale, rtol=1e-6, atol=1e-7)


def test_drgrpo_has_no_std():
    adv, _, _ = compute_advantages("drgrpo", REWARDS, UIDS)
    assert adv.tolist() == [-1.0, -2.0, 1.0, -2.0, 4.0]


def test_zero_variance_groups_counted_and_dropped():
    # a: {0.1, 0.1, 0.1} (its float mean is not exactly 0.1), b: {1, 0}, c: a single row.
    uids = np.array(["a", "a", "b", "b", "c", "a"], dtype=object)
    rewards = torch.tensor([0.1, 0.1, 1.0, 0.0, 0.7, 0.1], dtype=torch.float64)
    adv, stats, keep = compute_advantages("grpo", rewards, uids)
    assert keep.all()
    assert stats["zero_std_group_frac"] == pytest.approx(2 / 3)
    assert adv[[0, 1, 4, 5]].abs().max() < 1e-9  # equal rewards -> (almost exactly) zero advantage

    adv, stats, keep = compute_advantages("grpo", rewards, uids, drop_zero_std_groups=True)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert adv.dtype == torch.float64
    assert adv.tolist()[:2] + adv.tolist()[4:] == [0.0, 0.0, 0.0, 0.0]  # dropped rows are exactly 0
    # b: mean 0.5, std 0.5
    torch.testing.assert_close(adv[2:4], torch.tensor([0.5 / 0.5001, -0.5 / 0.5001], dtype=torch.float64))
    assert stats["kept_frac"] == pytest.approx(2 / 6)
    assert stats["advantage_abs_mean"] == pytest.approx(0.5 / 0.5001)


def test_all_groups_dropped_leaves_nothing_to_train():
    adv, stats, keep = compute_advantages("drgrpo", torch.ones(4), ["x", "x", "y", "y"], drop_zero_std_groups=True)
    assert not keep.any() and adv.abs().sum() == 0
    assert stats["kept_frac"] == 0.0 and stats["advantage_abs_mean"] == 0.0 and stats["zero_std_group_frac"] == 1.0


def test_per_prompt_tracker_uses_history_across_steps():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)

    # Step 1: each prompt has 2 < min_count rewards -> batch mean 1.5, batch std sqrt(5/4).
    adv = tracker.update(["p", "p", "q", "q"], [1.0, 3.0, 0.0, 2.0])
    batch = math.sqrt(1.25) + EPS
    np.testing.assert_allclose(adv, [-0.5 / batch, 1.5 / batch, -1.5 / batch, 0.5 / batch], rtol=1e-12)

    # Step 2: p's buffer {1, 3, 5, 7}: mean 4, std sqrt(5); q's {0, 2, 2, 2}: mean 1.5, std sqrt(0.75).
    adv = tracker.update(["p", "q", "p", "q"], [5.0, 2.0, 7.0, 2.0])
    p, q = math.sqrt(5) + EPS, math.sqrt(0.75) + EPS
    np.testing.assert_allclose(adv, [1 / p, 0.5 / q, 3 / p, 0.5 / q], rtol=1e-12)

    # Step 3: the buffer keeps the last 4: p's {5, 7, 9, 9}: mean 7.5, std sqrt(11/4).
    adv = tracker.update(["p", "p"], [9.0, 9.0])
    np.testing.assert_allclose(adv, [1.5 / (math.sqrt(2.75) + EPS)] * 2, rtol=1e-12)
    assert tracker.stats() == {"tracked_prompts": 2.0, "mean_buffer_len": 4.0}

    # The history survives a checkpoint round trip.
    restored = PerPromptStatTracker(buffer_size=4, min_count=3)
    restored.load_state_dict(tracker.state_dict())
    np.testing.assert_array_equal(restored.update(["q", "q"], [0.0, 4.0]), tracker.update(["q", "q"], [0.0, 4.0]))


def test_per_prompt_through_the_registry_and_clear_gives_grpo():
    tracker = PerPromptStatTracker(buffer_size=None, min_count=2)
    adv, stats, _ = compute_advantages("per_prompt", REWARDS, UIDS, tracker=tracker, prompts=list(UIDS))
    expected, _, _ = compute_advantages("grpo", REWARDS, UIDS)  # a fresh history is this step's group
    torch.testing.assert_close(adv, expected)
    tracker.clear()
    assert tracker.history == {}


def test_unknown_names_and_options_list_what_exists():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gpro'.*'drgrpo'.*'global_std'.*'grpo'"):
        compute_advantages("gpro", REWARDS, UIDS)
    with pytest.raises(ValueError, match=r"'grpo' has no option 'epsilon'; its options: \['eps'\]"):
        compute_advantages("grpo", REWARDS, UIDS, epsilon=1.0)
    with pytest.raises(ValueError, match=r"'per_prompt' needs option 'tracker'"):
        compute_advantages("per_prompt", REWARDS, UIDS, prompts=list(UIDS))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda rewards, groups: rewards)
    assert {"grpo", "global_std", "drgrpo", "per_prompt"} <= set(ADVANTAGES)


def test_bad_rewards_are_rejected():
    with pytest.raises(ValueError, match=r"rows \[1\] are NaN or inf"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), ["a", "a"])
    with pytest.raises(ValueError, match="uids has 3 entries but rewards has 2 rows"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0]), ["a", "a", "b"])
    with pytest.raises(ValueError, match="1-D float tensor"):
        compute_advantages("grpo", torch.ones(2, 1), ["a", "b"])
    with pytest.raises(ValueError, match="min_count"):
        PerPromptStatTracker(buffer_size=4, min_count=8)

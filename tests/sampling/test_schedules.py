"""Sigma schedules: endpoints, monotonicity, and the two shifts against hand-computed values."""

import math

import pytest
import torch

from flowloop.sampling import resolution_shift_mu, sigmas, time_shift_exponential, time_shift_linear


@pytest.mark.parametrize("num_steps", [1, 2, 10, 40])
@pytest.mark.parametrize("kwargs", [{}, {"shift": 3.0}, {"shift": 0.5}, {"mu": 1.15}, {"mu": -0.3}])
def test_endpoints_dtype_and_monotonic(num_steps, kwargs):
    s = sigmas(num_steps, **kwargs)
    assert s.shape == (num_steps + 1,)
    assert s.dtype == torch.float32
    assert s[0].item() == 1.0
    assert s[-1].item() == 0.0
    assert bool((s[1:] < s[:-1]).all()), s


def test_linear_grid_without_shift():
    expected = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.equal(sigmas(4), expected)


def test_sd3_shift_hand_computed():
    # 3t / (1 + 2t) at t = 0.75, 0.5, 0.25 -> 2.25/2.5, 1.5/2, 0.75/1.5
    expected = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0])
    torch.testing.assert_close(sigmas(4, shift=3.0), expected, rtol=0, atol=1e-7)
    assert time_shift_linear(3.0, 0.5) == pytest.approx(0.75)


def test_resolution_mu_hand_computed():
    assert resolution_shift_mu(256) == pytest.approx(0.5)
    assert resolution_shift_mu(4096) == pytest.approx(1.15)
    # 0.5 + (1024 - 256) * 0.65 / 3840 = 0.5 + 0.13
    assert resolution_shift_mu(1024) == pytest.approx(0.63)
    # Qwen-Image's constants
    assert resolution_shift_mu(8192, max_seq_len=8192, max_shift=0.9) == pytest.approx(0.9)
    # extrapolated beyond max_seq_len, as diffusers' calculate_shift
    assert resolution_shift_mu(7936) == pytest.approx(0.5 + 7680 * 0.65 / 3840)


def test_exponential_shift_hand_computed():
    # exp(ln 2) / (exp(ln 2) + 1/0.5 - 1) = 2 / 3
    assert time_shift_exponential(math.log(2.0), 0.5) == pytest.approx(2.0 / 3.0)
    assert time_shift_exponential(0.7, 0.0) == 0.0
    t = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    got = time_shift_exponential(math.log(2.0), t)
    torch.testing.assert_close(got, torch.tensor([0.0, 2.0 / 5.0, 1.0], dtype=torch.float64))


def test_resolution_shift_schedule_matches_formula():
    mu = resolution_shift_mu(1024 // 16 * 1024 // 16)  # 64x64 tokens
    s = sigmas(10, mu=mu)
    expected = []
    for k in range(11):
        t = 1.0 - k / 10
        expected.append(0.0 if t == 0 else math.exp(mu) / (math.exp(mu) + 1 / t - 1))
    torch.testing.assert_close(s, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-7)
    # the shift moves every interior point towards noise
    assert bool((s[1:-1] > sigmas(10)[1:-1]).all())


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_num_steps(bad):
    with pytest.raises(ValueError, match="num_steps"):
        sigmas(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_shift(bad):
    with pytest.raises(ValueError, match="shift"):
        sigmas(10, shift=bad)


def test_shift_and_mu_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        sigmas(10, shift=3.0, mu=1.0)


def test_bad_resolution_arguments():
    with pytest.raises(ValueError, match="max_seq_len"):
        resolution_shift_mu(1024, base_seq_len=4096, max_seq_len=256)
    with pytest.raises(ValueError, match="image_seq_len"):
        resolution_shift_mu(0)

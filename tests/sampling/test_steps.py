"""Sampling steps: means and log-probs against independent float64 formulas, replay, batch
invariance, dtypes and validation."""

import math

import pytest
import torch

from flowloop.sampling import (
    STEPS,
    cps_step,
    dance_step,
    gaussian_log_prob,
    get_step,
    ode_step,
    randn_per_sample,
    sde_step,
)

SHAPE = (4, 3, 5, 6)  # [B, C, H, W]
# (sigma, sigma_next) pairs: the first step, a middle step, the last step.
FIRST, MIDDLE, LAST = (1.0, 0.75), (0.6, 0.45), (0.2, 0.0)


def _inputs(seed=0, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    eps = torch.randn(shape, generator=g)
    return x.to(dtype), v.to(dtype), eps


# ---- independent float64 references, written from DESIGN.md's formulas ------------------------


def _ref_sde(x, v, t, tn, a):
    s = a * math.sqrt(t / (1 - (tn if t == 1 else t)))
    dt = tn - t
    return x + (v + s**2 / (2 * t) * (x + (1 - t) * v)) * dt, s * math.sqrt(-dt)


def _ref_cps(x, v, t, tn, a):
    x0, x1 = x - t * v, x + (1 - t) * v
    s = tn * math.sin(a * math.pi / 2)
    return (1 - tn) * x0 + math.sqrt(tn**2 - s**2) * x1, s


def _ref_dance(x, v, t, tn, a):
    x0 = x - t * v
    score = -(x - (1 - t) * x0) / t**2
    dt = tn - t
    return x + v * dt - a**2 / 2 * score * dt, a * math.sqrt(-dt)


def _ref_log_density(x, mean, std):
    x, mean = x.double(), mean.double()
    std = torch.as_tensor(std, dtype=torch.float64).expand_as(x)
    per_element = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return per_element.flatten(1).mean(1)


STOCHASTIC = [
    pytest.param(sde_step, _ref_sde, 0.7, {}, id="sde"),
    pytest.param(cps_step, _ref_cps, 0.8, {}, id="cps"),
    pytest.param(cps_step, _ref_cps, 0.8, {"logprob_mode": "flow_grpo"}, id="cps-flow_grpo"),
    pytest.param(dance_step, _ref_dance, 0.3, {}, id="dance"),
]


# ---- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("step, ref, a, kw", STOCHASTIC)
@pytest.mark.parametrize("t, tn", [FIRST, MIDDLE])
def test_mean_std_and_log_prob_match_float64(step, ref, a, kw, t, tn):
    x, v, eps = _inputs()
    out = step(v, t, tn, x, noise_level=a, noise=eps, **kw)
    mean64, std64 = ref(x.double(), v.double(), t, tn, a)

    torch.testing.assert_close(out.mean.double(), mean64, rtol=1e-5, atol=1e-5)
    assert out.std.shape == (SHAPE[0], 1, 1, 1)
    torch.testing.assert_close(out.std.double(), torch.full_like(out.std.double(), std64))
    expected_prev = mean64 + std64 * eps.double()
    torch.testing.assert_close(out.prev_sample.double(), expected_prev, rtol=1e-5, atol=1e-5)

    if kw.get("logprob_mode") == "flow_grpo":
        expected = -((out.prev_sample.double() - out.mean.double()) ** 2).flatten(1).mean(1)
    else:
        expected = _ref_log_density(out.prev_sample, out.mean, out.std)
    assert out.log_prob.shape == (SHAPE[0],) and out.log_prob.dtype == torch.float32
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-6, atol=1e-6)


def test_sde_at_t_one_uses_sigma_next_in_denominator():
    x, v, eps = _inputs()
    out = sde_step(v, 1.0, 0.75, x, noise_level=0.5, noise=eps)
    # s = 0.5 * sqrt(1 / (1 - 0.75)) = 1, std = s * sqrt(0.25) = 0.5
    assert torch.equal(out.std, torch.full((SHAPE[0], 1, 1, 1), 0.5))
    assert bool(torch.isfinite(out.log_prob).all())


def test_gaussian_log_prob_helper():
    x, mean, _ = _inputs(seed=3)
    std = torch.rand(SHAPE[0], 1, 1, 1) + 0.1
    got = gaussian_log_prob(x, mean, std)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _ref_log_density(x, mean, std), rtol=1e-6, atol=1e-6)
    # a density, not a distance: the constant and the scale matter
    assert not torch.allclose(got, gaussian_log_prob(x, mean, 2 * std))


def test_cps_log_prob_modes_differ():
    x, v, eps = _inputs()
    density = cps_step(v, *MIDDLE, x, noise_level=0.8, noise=eps)
    flow_grpo = cps_step(v, *MIDDLE, x, noise_level=0.8, noise=eps, logprob_mode="flow_grpo")
    assert torch.equal(density.prev_sample, flow_grpo.prev_sample)
    assert not torch.allclose(density.log_prob, flow_grpo.log_prob)


def test_ode_is_euler():
    x, v, _ = _inputs()
    out = ode_step(v, *MIDDLE, x)
    torch.testing.assert_close(out.prev_sample, x + v * (MIDDLE[1] - MIDDLE[0]))
    assert torch.equal(out.log_prob, torch.zeros(SHAPE[0]))
    assert torch.equal(out.std, torch.zeros(SHAPE[0], 1, 1, 1))


@pytest.mark.parametrize("t, tn", [FIRST, MIDDLE, LAST])
def test_sde_with_zero_noise_is_ode(t, tn):
    x, v, eps = _inputs()
    sde = sde_step(v, t, tn, x, noise_level=0.0, noise=eps)
    ode = ode_step(v, t, tn, x)
    assert torch.equal(sde.prev_sample, ode.prev_sample)
    assert torch.equal(sde.mean, ode.mean)
    assert torch.equal(sde.log_prob, torch.zeros(SHAPE[0]))


# ---- the last step (sigma_next = 0) -----------------------------------------------------------


def test_cps_last_step_is_deterministic_with_zero_log_prob():
    x, v, eps = _inputs()
    v.requires_grad_(True)
    out = cps_step(v, *LAST, x, noise_level=0.8, noise=eps)
    assert torch.equal(out.std, torch.zeros(SHAPE[0], 1, 1, 1))
    assert torch.equal(out.prev_sample, out.mean)
    torch.testing.assert_close(out.mean, x - LAST[0] * v)  # the x0 prediction
    assert torch.equal(out.log_prob, torch.zeros(SHAPE[0]))
    replay = cps_step(v, *LAST, x, noise_level=0.8, prev_sample=out.prev_sample.detach() + 1.0)
    assert torch.equal(replay.log_prob, torch.zeros(SHAPE[0]))
    replay.log_prob.sum().backward()
    assert bool(torch.isfinite(v.grad).all())


@pytest.mark.parametrize("step, a", [(sde_step, 0.7), (dance_step, 0.3)])
def test_other_steps_are_finite_on_the_last_step(step, a):
    x, v, eps = _inputs()
    out = step(v, *LAST, x, noise_level=a, noise=eps)
    assert bool((out.std > 0).all())
    assert bool(torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all())


# ---- replay, batch invariance, dtypes -----------------------------------------------------------


@pytest.mark.parametrize("step, ref, a, kw", STOCHASTIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_reproduces_log_prob_bitwise(step, ref, a, kw, dtype):
    x, v, eps = _inputs(dtype=dtype)
    sigma = torch.tensor([1.0, 0.8, 0.6, 0.4])  # one sigma per sample
    sigma_next = torch.tensor([0.9, 0.7, 0.5, 0.3])
    out = step(v, sigma, sigma_next, x, noise_level=a, noise=eps, **kw)
    replay = step(v, sigma, sigma_next, x, noise_level=a, prev_sample=out.prev_sample, **kw)
    assert torch.equal(replay.log_prob, out.log_prob)
    assert torch.equal(replay.prev_sample, out.prev_sample)
    moved = step(v, sigma, sigma_next, x, noise_level=a, prev_sample=out.prev_sample + 0.1, **kw)
    assert not torch.equal(moved.log_prob, out.log_prob)


def test_replay_log_prob_has_gradient_wrt_velocity():
    x, v, eps = _inputs()
    out = sde_step(v, *MIDDLE, x, noise_level=0.7, noise=eps)
    v = v.clone().requires_grad_(True)
    replay = sde_step(v, *MIDDLE, x, noise_level=0.7, prev_sample=out.prev_sample)
    replay.log_prob.sum().backward()
    assert bool(torch.isfinite(v.grad).all()) and v.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("per_sample_sigma", [False, True])
def test_a_sample_alone_equals_its_row_in_a_batch(name, per_sample_sigma):
    # 16*48*48 elements per sample: large enough that torch splits a batched reduction
    # differently for 1 and for 8 rows.
    step, batch, shape = get_step(name), 8, (8, 16, 48, 48)
    x, v, _ = _inputs(seed=1, shape=shape)
    if per_sample_sigma:
        sigma = torch.linspace(1.0, 0.3, batch)
        sigma_next = sigma - 0.1
    else:
        sigma, sigma_next = torch.tensor(0.6), torch.tensor(0.5)
    seeds = [1000 + i for i in range(batch)]
    batched = step(
        v, sigma, sigma_next, x, noise_level=0.7,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
    )
    for i in (0, 5):
        alone = step(
            v[i : i + 1],
            sigma[i : i + 1] if per_sample_sigma else sigma,
            sigma_next[i : i + 1] if per_sample_sigma else sigma_next,
            x[i : i + 1],
            noise_level=0.7,
            generators=[torch.Generator().manual_seed(seeds[i])],
        )
        for field in ("prev_sample", "log_prob", "mean", "std"):
            assert torch.equal(getattr(alone, field)[0], getattr(batched, field)[i]), (name, field)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_bf16_inputs_give_float32_outputs(name):
    x, v, eps = _inputs(dtype=torch.bfloat16)
    out = get_step(name)(v, *MIDDLE, x, noise_level=0.5, noise=eps)
    for field in out:
        assert field.dtype == torch.float32
    # the step upcasts first: same result as float32 inputs holding the bf16 values
    ref = get_step(name)(v.float(), *MIDDLE, x.float(), noise_level=0.5, noise=eps)
    assert torch.equal(out.log_prob, ref.log_prob)
    assert torch.equal(out.prev_sample, ref.prev_sample)


def test_randn_per_sample_rows_come_from_their_own_generator():
    gens = [torch.Generator().manual_seed(s) for s in (7, 8, 9)]
    noise = randn_per_sample(gens, (3, 2, 4))
    assert noise.shape == (3, 2, 4) and noise.dtype == torch.float32
    assert torch.equal(noise[1], torch.randn(2, 4, generator=torch.Generator().manual_seed(8)))
    with pytest.raises(ValueError, match="one generator per sample"):
        randn_per_sample(gens, (4, 2, 4))
    with pytest.raises(ValueError, match="sequence"):
        randn_per_sample(gens[0], (1, 2, 4))


# ---- registry and validation --------------------------------------------------------------------


def test_registry():
    assert set(STEPS) == {"ode", "sde", "cps", "dance"}
    assert get_step("cps") is cps_step and get_step("ode") is ode_step
    with pytest.raises(ValueError) as info:
        get_step("flow_sde")
    for name in ("ode", "sde", "cps", "dance"):
        assert name in str(info.value)


def test_validation():
    x, v, eps = _inputs()
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(v, *MIDDLE, x, noise_level=-0.1, noise=eps)
    with pytest.raises(ValueError, match="noise_level"):
        cps_step(v, *MIDDLE, x, noise_level=1.5, noise=eps)
    with pytest.raises(ValueError, match="logprob_mode"):
        cps_step(v, *MIDDLE, x, noise_level=0.5, noise=eps, logprob_mode="l2")
    with pytest.raises(ValueError, match="needs noise"):
        sde_step(v, *MIDDLE, x, noise_level=0.7)
    with pytest.raises(ValueError, match="not both"):
        sde_step(v, *MIDDLE, x, noise_level=0.7, noise=eps, prev_sample=x)
    with pytest.raises(ValueError, match="not both"):
        sde_step(v, *MIDDLE, x, noise_level=0.7, noise=eps, generators=[torch.Generator()] * 4)
    with pytest.raises(ValueError, match="noise"):
        dance_step(v, *MIDDLE, x, noise_level=0.7, noise=eps[:2])
    with pytest.raises(ValueError, match="sigma"):
        sde_step(v, torch.tensor([0.5, 0.6]), 0.4, x, noise_level=0.7, noise=eps)
    with pytest.raises(ValueError, match="velocity"):
        ode_step(v[:2], *MIDDLE, x)

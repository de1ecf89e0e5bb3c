"""The actor's learning-rate schedule against hand-computed values."""

import pytest

from flowloop.config.train import ActorConfig
from flowloop.trainer.actor import lr_factor


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 0.7, 0.4, 0.1]),  # warm-up 2, then down to 0.1 at step 4 of 5
    ("cosine", [0.5, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]),
])
def test_lr_factor_warms_up_then_decays_to_the_floor(schedule, expected):
    config = ActorConfig(warmup_steps=2, lr_schedule=schedule, lr_final_ratio=0.1)
    factor = lr_factor(config, total_steps=5)
    assert [factor(s) for s in range(5)] == pytest.approx(expected)
    assert factor(9) == pytest.approx(expected[-1])  # past the plan it stays at the floor


def test_a_decaying_schedule_needs_the_planned_steps():
    with pytest.raises(ValueError, match="actor.lr_schedule='cosine' needs the run's planned optimizer steps"):
        lr_factor(ActorConfig(lr_schedule="cosine"), None)
    assert lr_factor(ActorConfig(), None)(10) == 1.0


def test_a_warm_up_as_long_as_the_run_is_an_error_for_a_decay():
    with pytest.raises(ValueError, match="actor.warmup_steps=8 leaves no room for the linear decay: the run plans 8"):
        lr_factor(ActorConfig(warmup_steps=8, lr_schedule="linear"), 8)
    assert lr_factor(ActorConfig(warmup_steps=8), 8)(7) == 1.0  # constant: warm-up only

"""`flowloop.config.rollout`: defaults, merging into sampling params, and validation."""

from __future__ import annotations

import pytest

from flowloop.config import load_config
from flowloop.config.rollout import RolloutConfig
from flowloop.rollout.types import SamplingParams


def test_defaults_merge_into_valid_sampling_params():
    config = load_config(RolloutConfig)
    train, val = (SamplingParams.from_dict(config.sampling_dict(validate)) for validate in (False, True))
    train.validate()
    val.validate()
    assert (train.sampler, train.num_inference_steps, train.logprobs) == ("sde", 10, True)
    assert (val.sampler, val.num_inference_steps, val.logprobs) == ("ode", 40, False)
    assert val.height == train.height == 32


def test_overrides_reach_the_sampling_params():
    config = load_config(RolloutConfig, ["algo.sampler=cps", "algo.sde_window_size=2", "algo.sde_window_range=[0,5]",
                                         "val_kwargs.pipeline.height=16", "calculate_log_probs=false"])
    train = SamplingParams.from_dict(config.sampling_dict(False))
    assert (train.sampler, train.sde_window_size, train.sde_window_range, train.logprobs) == ("cps", 2, (0, 5), False)
    assert SamplingParams.from_dict(config.sampling_dict(True)).height == 16


@pytest.mark.parametrize(
    "override, error",
    [
        ("reward.failure_policy=ignore", r"reward.failure_policy must be one of \['fail', 'drop_group'\]"),
        ("val_kwargs.algo.samplr=ode", r"val_kwargs.algo has unknown key\(s\) \['samplr'\]"),
        ("val_kwargs.pipeline.height=tall", r"val_kwargs.pipeline"),
        ("agent.num_workers=0", r"agent.num_workers must be >= 1"),
        ("prompt_length=0", r"prompt_length must be >= 1"),
        ("reward.max_wait_ms=-1", r"reward.max_wait_ms must be >= 0"),
        ("server.cpu_shards=0", r"server.cpu_shards must be >= 1 \(1: off\) or null"),
        ("agent.num_wrkers=2", r"unknown config key"),
    ],
)
def test_bad_values_are_explained(override, error):
    with pytest.raises(ValueError, match=error):
        load_config(RolloutConfig, [override])


def test_mapping_without_spaces_after_colons_gets_a_hint():
    from flowloop.config.train import TrainConfig

    with pytest.raises(ValueError, match=r"color_attr:2.*space after each colon"):
        load_config(TrainConfig, ["data.category_weights={color_attr:2,position:2}"])
    config = load_config(TrainConfig, ["data.category_weights={color_attr: 2, position: 2}"])
    assert config.data.category_weights == {"color_attr": 2.0, "position": 2.0}

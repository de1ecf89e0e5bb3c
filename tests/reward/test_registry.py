"""The reward registry: names, ``module:function`` paths, kwargs, factories, and errors that name the reward."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowloop.reward import RewardSample, RewardWorker, build_reward, get_reward, register_reward, registered_rewards
from flowloop.reward.shapes import shapes_reward
from tests.reward.test_worker import score_all


def test_shapes_is_registered():
    assert get_reward("shapes") is shapes_reward
    assert "shapes" in registered_rewards()


def test_unknown_reward_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown reward 'no_such_reward'; registered rewards: \[.*'shapes'.*\]"):
        get_reward("no_such_reward")


def test_a_name_cannot_be_taken_twice():
    @register_reward("test_twice")
    def first(images, prompts, metadata):
        return [], []

    register_reward("test_twice")(first)  # the same function again is fine (module reloads)

    with pytest.raises(ValueError, match=r"reward 'test_twice' is already registered to .*first"):

        @register_reward("test_twice")
        def second(images, prompts, metadata):
            return [], []


# -- building: module:function, kwargs, factories -------------------------------------------------
def scaled(images, prompts, metadata, *, factor: float = 1.0):
    """A plain batched function with a keyword argument (bound from ``reward.kwargs``)."""
    return [factor * float(images[i].mean()) for i in range(len(prompts))], [{"factor": factor} for _ in prompts]


@register_reward("test_offset_factory", factory=True)
def offset_factory(offset: float, device: str = "cpu"):
    """A factory: called once with the kwargs, returns the batched function."""
    base = torch.tensor(offset, device=device)

    def score(images, prompts, metadata):
        return [float(base) for _ in prompts], [{"device": str(base.device)} for _ in prompts]

    return score


class CountingScorer:
    """A class is a factory too: its instances are the batched functions."""

    def __init__(self, start: int = 0):
        self.calls = start

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        return [float(self.calls)] * len(prompts), [{} for _ in prompts]


def nan_reward(images, prompts, metadata):
    return [float("nan")] * len(prompts), [{} for _ in prompts]


def short_reward(images, prompts, metadata):
    return [1.0] * (len(prompts) - 1), [{} for _ in prompts]


IMAGES = torch.full((2, 3, 4, 4), 0.5)


def test_module_function_is_imported_and_kwargs_are_bound():
    fn = build_reward("tests.reward.test_registry:scaled", {"factor": 3.0})
    scores, extra = fn(IMAGES, ["a", "b"], [{}, {}])
    assert scores == [1.5, 1.5] and extra == [{"factor": 3.0}, {"factor": 3.0}]
    assert get_reward("tests.reward.test_registry:scaled") is scaled
    assert build_reward("tests.reward.test_registry:scaled") is scaled  # no kwargs: the function itself


def test_factories_are_called_once_with_the_kwargs():
    fn = build_reward("test_offset_factory", {"offset": 2.5, "device": "cpu"})
    assert fn(IMAGES, ["a", "b"], [{}, {}]) == ([2.5, 2.5], [{"device": "cpu"}, {"device": "cpu"}])
    counter = build_reward("tests.reward.test_registry:CountingScorer", {"start": 10})
    counter(IMAGES, ["a"], [{}])
    assert counter(IMAGES, ["a"], [{}])[0] == [12.0]  # one object across calls: state (a model) is built once


@pytest.mark.parametrize("name,kwargs,message", [
    ("no_such_module_xyz:score", None,
     r"reward 'no_such_module_xyz:score': cannot import module 'no_such_module_xyz': ModuleNotFoundError: No module named"),
    ("tests.reward.test_registry:nope", None, r"module 'tests.reward.test_registry' has no attribute 'nope'"),
    ("tests.reward.test_registry:IMAGES", None, r"is a Tensor, not a function or factory"),
    ("tests.reward.test_registry:", None, r"must be 'package.module:function'"),
    ("tests.reward.test_registry:scaled", {"factr": 2}, r"reward 'tests.reward.test_registry:scaled': bad kwargs \['factr'\] .*it accepts \['factor'\]"),
    ("test_offset_factory", {}, r"reward 'test_offset_factory': bad kwargs \[\] \(missing a required argument: 'offset'\); it accepts \['offset', 'device'\]"),
    ("shapes", {"device": "cuda"}, r"reward 'shapes': bad kwargs \['device'\]"),
])
def test_bad_names_and_kwargs_fail_at_build_time(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_reward(name, kwargs)


def test_a_module_that_fails_to_import_says_why(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import numpy\nraise ImportError('needs the paddleocr package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"cannot import module 'broken_reward_mod': ImportError: needs the paddleocr package"):
        RewardWorker("broken_reward_mod:score")


def test_an_unknown_name_mentions_module_paths():
    with pytest.raises(ValueError, match=r"registered rewards: \[.*'combined'.*'jpeg_compressibility'.*'remote'.*'shapes'.*\] "
                                         r"\(or give 'package.module:function'\)"):
        get_reward("pickscore_v9")


def test_nan_and_wrong_counts_are_errors_naming_the_reward():
    samples = [RewardSample(torch.zeros(3, 4, 4), "a"), RewardSample(torch.zeros(3, 4, 4), "b")]
    for name, message in (("tests.reward.test_registry:nan_reward", "returned a non-finite score nan"),
                          ("tests.reward.test_registry:short_reward", "returned 0 scores and 1 extra_info for 1 samples")):
        results = asyncio.run(score_all(RewardWorker(name, max_wait_ms=20), samples))
        assert [r.score for r in results] == [None, None]
        assert all(f"reward {name!r} {message}" in r.extra_info["reward_error"] for r in results)


def test_reward_kwargs_reach_the_worker_through_config():
    from flowloop.config import load_config
    from flowloop.config.rollout import RolloutConfig

    cfg = load_config(RolloutConfig, ["reward.name=test_offset_factory", "reward.kwargs={offset: 4.0, device: cpu}"])
    worker = RewardWorker(cfg.reward.name, cfg.reward.max_batch_size, cfg.reward.max_wait_ms, cfg.reward.kwargs)
    assert worker.fn(IMAGES, ["a"], [{}])[0] == [4.0]
    with pytest.raises(ValueError, match="reward.kwargs is set \\(\\['offset'\\]\\) but reward.name is null"):
        load_config(RolloutConfig, ["reward.name=null", "reward.kwargs.offset=1"])

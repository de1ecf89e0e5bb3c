"""The reward registry."""

from __future__ import annotations

import pytest

from flowloop.reward import get_reward, register_reward, registered_rewards
from flowloop.reward.shapes import shapes_reward


def test_shapes_is_registered():
    assert get_reward("shapes") is shapes_reward
    assert "shapes" in registered_rewards()


def test_unknown_reward_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown reward 'ocr'; registered rewards: \[.*'shapes'.*\]"):
        get_reward("ocr")


def test_a_name_cannot_be_taken_twice():
    @register_reward("test_twice")
    def first(images, prompts, metadata):
        return [], []

    register_reward("test_twice")(first)  # the same function again is fine (module reloads)

    with pytest.raises(ValueError, match=r"reward 'test_twice' is already registered to .*first"):

        @register_reward("test_twice")
        def second(images, prompts, metadata):
            return [], []

"""Category focus: draw weights that follow each category's moving training accuracy."""

import numpy as np
import pytest

from flowloop.trainer.category_focus import CategoryFocus


def test_probs_follow_the_miss_rate_with_a_floor_and_unseen_categories_at_full_weight():
    focus = CategoryFocus(["a", "b", "c", "d"], np.array([1.0, 1.0, 1.0, 2.0]), focus=1.0)
    assert focus.probs() == pytest.approx([0.2, 0.2, 0.2, 0.4])  # nothing seen: the base weights
    focus.observe({"a": 0.5, "b": 1.0, "d": 0.75})
    # a: 1 - 0.5; b: solved, kept at the floor 0.1; c: unseen, 1; d: 2 x (1 - 0.75)
    assert focus.probs() == pytest.approx(np.array([0.5, 0.1, 1.0, 0.5]) / 2.1)
    focus.observe({"a": 0.0})  # moving average: 0.9 x 0.5 + 0.1 x 0 = 0.45; b, d unchanged
    assert focus.accuracy[:2] == pytest.approx([0.45, 1.0])
    assert focus.probs() == pytest.approx(np.array([0.55, 0.1, 1.0, 0.5]) / 2.15)


def test_a_higher_focus_sharpens_the_draw_and_state_round_trips():
    soft, sharp = (CategoryFocus(["a", "b"], np.ones(2), focus=f) for f in (1.0, 2.0))
    for f in (soft, sharp):
        f.observe({"a": 0.2, "b": 0.6})
    assert soft.probs() == pytest.approx([0.8 / 1.2, 0.4 / 1.2])
    assert sharp.probs() == pytest.approx([0.64 / 0.8, 0.16 / 0.8])
    copy = CategoryFocus(["a", "b"], np.ones(2), focus=2.0)
    copy.load_state_dict(sharp.state_dict())
    assert copy.probs() == pytest.approx(sharp.probs())

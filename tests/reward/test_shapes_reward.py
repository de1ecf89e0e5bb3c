"""The shapes rewards on rendered scenes: ``shapes_exact`` takes away the surplus-object shortcut."""

import dataclasses

import numpy as np
import pytest
import torch

from flowloop.reward import get_reward
from flowloop.tasks import shapes
from flowloop.tasks.shapes.render import render
from flowloop.tasks.shapes.scene import SceneObject, scene_for


def _image(scene) -> torch.Tensor:
    return torch.from_numpy(render(scene, 32)).permute(2, 0, 1).float() / 255.0  # [3, H, W]


def test_exact_reward_penalizes_only_surplus_objects():
    prompt = "a red circle and a blue square"
    scene = scene_for(shapes.parse_prompt(prompt), np.random.default_rng(0))
    assert len(scene.objects) == 2
    # One more red circle, bottom left, clear of the others: still correct by the GenEval-style check.
    extra = SceneObject("circle", "red", (0.25, 0.78), 0.16)
    assert all(abs(o.centre[0] - 0.25) + abs(o.centre[1] - 0.78) > 0.3 for o in scene.objects)
    crowded = dataclasses.replace(scene, objects=(*scene.objects, extra))
    images = torch.stack([_image(scene), _image(crowded)])
    plain, plain_info = get_reward("shapes")(images, [prompt] * 2, [{}, {}])
    exact, exact_info = get_reward("shapes_exact")(images, [prompt] * 2, [{}, {}])
    assert plain == [1.0, 1.0] and [i["correct"] for i in plain_info] == [True, True]
    n = len(plain_info[0]["constraints"])
    assert exact == [1.0, n / (n + 1)]
    assert [i["surplus_objects"] for i in exact_info] == [0, 1]
    assert [i["correct"] for i in exact_info] == [True, True]


def test_correct_weight_blends_partial_credit_with_all_constraints_met():
    prompt = "a red circle and a blue square"
    scene = scene_for(shapes.parse_prompt(prompt), np.random.default_rng(0))
    half = dataclasses.replace(scene, objects=scene.objects[:1])  # one of the two objects drawn
    images = torch.stack([_image(scene), _image(half)])
    dense, info = get_reward("shapes")(images, [prompt] * 2, [{}, {}])
    assert dense[0] == 1.0 and 0.0 < dense[1] < 1.0 and not info[1]["correct"]
    binary, _ = get_reward("shapes")(images, [prompt] * 2, [{}, {}], correct_weight=1.0)
    assert binary == [1.0, 0.0]
    mixed, _ = get_reward("shapes")(images, [prompt] * 2, [{}, {}], correct_weight=0.25)
    assert mixed[1] == pytest.approx(0.75 * dense[1])
    with pytest.raises(ValueError, match="correct_weight must be in"):
        get_reward("shapes")(images, [prompt] * 2, [{}, {}], correct_weight=2.0)


def test_exact_reward_penalizes_surplus_among_the_new_shapes_and_colours():
    prompt = "a black star and a cyan diamond"
    scene = scene_for(shapes.parse_prompt(prompt), np.random.default_rng(1), split="heldout")
    extra = SceneObject("star", "black", (0.5, 0.5), 0.13)
    crowded = dataclasses.replace(scene, objects=(*scene.objects, extra))
    images = torch.stack([_image(scene), _image(crowded)])
    plain, _ = get_reward("shapes")(images, [prompt] * 2, [{}, {}])
    exact, exact_info = get_reward("shapes_exact")(images, [prompt] * 2, [{}, {}])
    n = len(exact_info[0]["constraints"])
    assert plain == [1.0, 1.0]
    assert exact == [1.0, n / (n + 1)] and [i["surplus_objects"] for i in exact_info] == [0, 1]

"""The shapes world: grammar, split, scene sampler, renderer and verifier, checked end to end."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from flowloop.tasks.shapes import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    SHAPES,
    VOCABULARY,
    ObjectGroup,
    Spec,
    all_prompts,
    category_of,
    parse_prompt,
    prompt_for,
    render,
    sample_scene,
    scene_for,
    split_prompts,
    verify,
    verify_batch,
)
from flowloop.tasks.shapes.prompts import HELDOUT_COLOUR_SHAPES, HELDOUT_SHAPE_PAIRS, is_heldout_composition, train_colours
from flowloop.tasks.shapes.scene import GAP_PX, SIZE_RANGES, Scene, SceneObject

N_SCENES = 1000


@pytest.fixture(scope="module")
def scenes():
    rng = np.random.default_rng(0)
    return [sample_scene(rng) for _ in range(N_SCENES)]


@pytest.fixture(scope="module")
def renders(scenes):
    return {size: [render(scene, size) for scene in scenes] for size in (32, 64)}


def accuracy(images, scenes) -> float:
    return float(np.mean([verify(image, scene.spec).correct for image, scene in zip(images, scenes)]))


# ---- verifier on rendered scenes -----------------------------------------------------------


def test_samples_cover_every_category(scenes):
    assert {scene.category for scene in scenes} == set(CATEGORIES)
    assert {len(scene.objects) for scene in scenes} == {1, 2, 3, 4}


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_accepts_ground_truth(scenes, renders, size):
    assert accuracy(renders[size], scenes) >= 0.99


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_accepts_noisy_ground_truth(scenes, renders, size):
    rng = np.random.default_rng(1)
    noisy = [np.clip(image / 255.0 + rng.normal(0.0, 0.05, image.shape), 0.0, 1.0) for image in renders[size]]
    assert accuracy(noisy, scenes) >= 0.95


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("fill", [BACKGROUND, (0, 0, 0), (255, 255, 255), (128, 128, 128)])
def test_verifier_rejects_blank_images(scenes, size, fill):
    blank = np.broadcast_to(np.asarray(fill, dtype=np.uint8), (size, size, 3))
    assert accuracy([blank] * len(scenes), scenes) <= 0.02


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_rejects_uniform_noise(scenes, size):
    rng = np.random.default_rng(2)
    noise = [rng.random((size, size, 3)) for _ in scenes]
    assert accuracy(noise, scenes) <= 0.02


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_in_every_colour_reads_back_as_itself(shape):
    # One object per colour at the smallest and largest size the sampler draws, on the model's 32 px.
    rng = np.random.default_rng(15)
    for colour in COLOURS:
        for size in (SIZE_RANGES[0][0], SIZE_RANGES[-1][1]):
            centre = (float(rng.uniform(0.4, 0.6)), float(rng.uniform(0.45, 0.6)))
            scene = Scene(None, parse_prompt(f"one {colour} {shape}"), (SceneObject(shape, colour, centre, size),))
            verdict = verify(render(scene, 32), scene.spec)
            assert verdict.strict, (shape, colour, size, verdict.details["objects"])
            seen = verdict.details["objects"][0]
            others = {name: iou for name, iou in seen["overlaps"].items() if name != shape}
            assert seen["overlaps"][shape] > max(others.values()) + 0.05, (shape, colour, size, seen["overlaps"])


# ---- targeted verifier behaviour -----------------------------------------------------------


def recoloured(scene, index, colour):
    objects = list(scene.objects)
    objects[index] = dataclasses.replace(objects[index], colour=colour)
    return dataclasses.replace(scene, objects=tuple(objects))


def test_wrong_colour_fails_colour_but_keeps_shape():
    scene = scene_for(parse_prompt("a red circle and a blue square"), np.random.default_rng(3))
    circle = next(i for i, o in enumerate(scene.objects) if o.shape == "circle")
    verdict = verify(render(recoloured(scene, circle, "green")), "a red circle and a blue square")
    constraints = verdict.details["constraints"]
    assert not verdict.correct and 0.0 < verdict.score < 1.0
    assert constraints["a red circle"] is False
    assert constraints["a circle (any colour)"] is True
    assert constraints["a blue square"] is True
    assert verdict.score == pytest.approx(3 / 4)


def test_single_object_wrong_colour_gets_half_credit():
    scene = scene_for(parse_prompt("a purple triangle"), np.random.default_rng(4))
    verdict = verify(render(recoloured(scene, 0, "yellow")), scene.spec)
    assert verdict.score == pytest.approx(0.5)
    assert [o["colour"] for o in verdict.details["objects"]] == ["yellow"]


def test_wrong_count_fails():
    scene = scene_for(parse_prompt("two squares"), np.random.default_rng(5))
    image = render(scene)
    assert verify(image, "two squares").correct
    for prompt in ("three squares", "one square", "four squares"):
        verdict = verify(image, prompt)
        assert not verdict.correct and verdict.score == 0.0
    assert verify(image, "a square").correct  # "a" means at least one


def test_flipped_relation_fails_only_the_relation():
    rng = np.random.default_rng(6)
    for relation, flipped in [("to the left of", "to the right of"), ("above", "below")]:
        scene = scene_for(parse_prompt(f"a circle {relation} a square"), rng)
        image = render(scene)
        assert verify(image, f"a circle {relation} a square").correct
        verdict = verify(image, f"a circle {flipped} a square")
        assert verdict.details["constraints"] == {
            "a circle": True,
            "a square": True,
            f"a circle {flipped} a square": False,
        }
        assert verdict.score == pytest.approx(2 / 3)


def test_verify_accepts_every_image_type_and_details_are_json():
    scene = scene_for(parse_prompt("an orange triangle below a green circle"), np.random.default_rng(7))
    image = render(scene, 32)
    inputs = [image, image / 255.0, Image.fromarray(image)]
    torch = pytest.importorskip("torch")
    inputs.append(torch.from_numpy(image).permute(2, 0, 1).float() / 255.0)
    inputs.append(torch.from_numpy(image).permute(2, 0, 1).to(torch.bfloat16) / 255.0)
    for picture in inputs:
        verdict = verify(picture, scene.spec)
        assert verdict.correct, type(picture)
        json.dumps(verdict.details)
    assert [v.correct for v in verify_batch(torch.stack([inputs[3]] * 2), [scene.spec, "a red square"])] == [True, False]


def test_verify_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        verify(np.zeros((32, 32), dtype=np.uint8), "a circle")
    with pytest.raises(ValueError, match="dtype"):
        verify(np.zeros((32, 32, 3), dtype=np.int64), "a circle")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        verify(np.full((32, 32, 3), -1.0), "a circle")  # a [-1, 1] model output passed as is
    with pytest.raises(ValueError, match="same length"):
        verify_batch([np.zeros((32, 32, 3), dtype=np.uint8)], ["a circle", "a square"])


# ---- grammar and split ---------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_prompt_round_trip(category):
    rng = np.random.default_rng(8)
    for _ in range(20):
        scene = sample_scene(rng, category=category)
        assert scene.category == category
        assert parse_prompt(prompt_for(scene)) == scene.spec
    for prompt in all_prompts(category):
        spec = parse_prompt(prompt)
        assert spec.text() == prompt and category_of(spec) == category
        assert set(prompt.split()) <= set(VOCABULARY)


def test_category_sizes():
    assert {c: len(all_prompts(c)) for c in CATEGORIES} == {
        "single_object": 2 * 10 * 6,  # {a, one} x {no colour, 9 colours} x 6 shapes
        "two_objects": 4 * 30,  # {a, two} x {a, two} x ordered pairs of different shapes
        "counting": 10 * 3 * 6,  # {no colour, 9 colours} x {two, three, four} x 6 shapes
        "colors": 6 * 72,  # one shape in an ordered pair of different colours
        "position": 4 * 30,
        "color_attr": 30 * 72,
    }
    assert len(VOCABULARY) == len(set(VOCABULARY))


def test_compositional_prompts_parse():
    some, exactly = (lambda *a: ObjectGroup(1, False, *a)), (lambda n, *a: ObjectGroup(n, True, *a))
    assert parse_prompt("two red circles") == Spec((exactly(2, "circle", "red"),))
    assert parse_prompt("a green triangle above three squares") == Spec(
        (some("triangle", "green"), exactly(3, "square")), "above"
    )
    assert parse_prompt("  One  SQUARE to the right of an Orange circle. ") == Spec(
        (exactly(1, "square"), some("circle", "orange")), "to the right of"
    )
    assert parse_prompt("an circle") == parse_prompt("a circle")  # a/an are interchangeable
    assert category_of(parse_prompt("two red circles")) == "counting"
    assert category_of(parse_prompt("a red star and a blue star")) == "colors"
    assert category_of(parse_prompt("a red circle and two circles")) is None


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ("a brown circle", "'brown'"),
        ("a hexagon", "'hexagon'"),
        ("a circle beside a square", "'beside'"),
        ("a red circle.and", "'circle.and'"),
        ("circle red", "got 'circle'"),
        ("two circle", "'two' needs 'circles'"),
        ("a circles", "'a' needs 'circle'"),
        ("a red", "got the end"),
        ("a circle and", "got the end"),
        ("a circle a square", "expected 'and' or a relation"),
        ("a circle and a square and a triangle", "expected the end"),
        ("", "empty"),
    ],
)
def test_malformed_prompts_raise(prompt, needle):
    with pytest.raises(ValueError) as info:
        parse_prompt(prompt)
    assert needle in str(info.value)


def test_unknown_word_lists_allowed_words():
    with pytest.raises(ValueError, match="allowed words: a, an, one"):
        parse_prompt("a huge circle")


def test_split_is_fixed_disjoint_and_by_composition():
    train, heldout = split_prompts("train"), split_prompts("heldout")
    assert split_prompts("train") == train and split_prompts("heldout") == heldout
    assert not set(train) & set(heldout)
    for category in CATEGORIES:
        prompts = all_prompts(category)
        # train: every template prompt without a held-out composition; held-out: only such prompts
        assert split_prompts("train", category) == [p for p in prompts if not is_heldout_composition(parse_prompt(p))]
        assert all(is_heldout_composition(parse_prompt(p)) for p in split_prompts("heldout", category))
        assert set(split_prompts("heldout", category)) <= set(prompts)
    # Pinned: the split must not move between runs, machines or Python versions.
    assert hashlib.sha256("\n".join(heldout).encode()).hexdigest() == (
        "029e0b22118c703a5826f2f3b52f87f5334ab94b708301e5f4cbf6efeb682ba1"
    )
    with pytest.raises(ValueError, match="split"):
        split_prompts("test")


def test_every_category_has_at_least_30_heldout_prompts():
    counts = {c: len(split_prompts("heldout", c)) for c in CATEGORIES}
    assert counts == {"single_object": 36, "two_objects": 40, "counting": 48, "colors": 48, "position": 40,
                      "color_attr": 48}


def test_heldout_compositions_never_appear_in_training():
    for prompt in split_prompts("train"):
        groups = parse_prompt(prompt).groups
        assert not any((g.colour, g.shape) in HELDOUT_COLOUR_SHAPES for g in groups), prompt
        assert frozenset(g.shape for g in groups) not in HELDOUT_SHAPE_PAIRS, prompt
    # ... while every word of the vocabulary, every shape and every colour does.
    train_words = {word for prompt in split_prompts("train") for word in prompt.split()}
    assert train_words == set(VOCABULARY)
    for shape in SHAPES:
        assert len(train_colours(shape)) == len(COLOURS) - 3
    assert {colour for colour, _ in HELDOUT_COLOUR_SHAPES} == set(COLOURS)


def test_train_scenes_never_draw_a_heldout_composition():
    # Prompts leave colours free ("three stars"): the train sampler still never pairs them wrongly.
    rng = np.random.default_rng(14)
    for _ in range(400):
        objects = sample_scene(rng, split="train").objects
        assert not any((o.colour, o.shape) in HELDOUT_COLOUR_SHAPES for o in objects)
        shapes = {o.shape for o in objects}
        assert not any(pair <= shapes for pair in HELDOUT_SHAPE_PAIRS)
    # Without a split, a free colour is any colour (held-out scenes, the verifier benchmark).
    stars = [scene_for(parse_prompt("a star"), rng).objects[0].colour for _ in range(200)]
    assert set(stars) == set(COLOURS)


def test_sample_scene_respects_split():
    rng = np.random.default_rng(9)
    heldout = set(split_prompts("heldout"))
    assert all(sample_scene(rng, split="heldout").prompt in heldout for _ in range(200))
    assert not any(sample_scene(rng, split="train").prompt in heldout for _ in range(200))


# ---- scenes and rendering ------------------------------------------------------------------


def test_sampled_layouts_are_separated_and_legible(scenes):
    for scene in scenes:
        boxes = [o.bbox() for o in scene.objects]
        for i, a in enumerate(boxes):
            assert min(a[0], a[1]) > 0 and max(a[2], a[3]) < 1
            assert (a[2] - a[0]) * scene.canvas >= 7  # at least 7 px across at 32x32
            for b in boxes[i + 1 :]:
                gap = max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])
                assert gap * scene.canvas >= GAP_PX - 1e-9


@pytest.mark.parametrize(
    "prompt",
    [
        "two red circles",
        "a green triangle above three squares",
        "a circle to the left of a circle",
        "a red circle and two circles",
        "four circles to the left of four squares",
        "three blue triangles and four yellow squares",
    ],
)
def test_scene_for_any_prompt_verifies(prompt):
    rng = np.random.default_rng(10)
    spec = parse_prompt(prompt)
    for _ in range(10):
        assert verify(render(scene_for(spec, rng), 32), spec).correct


def test_scene_for_contradiction_raises():
    with pytest.raises(ValueError, match="contradict"):
        scene_for(parse_prompt("two red circles and one circle"), np.random.default_rng(11))


def test_render_shape_and_background():
    scene = scene_for(parse_prompt("a blue square"), np.random.default_rng(12))
    for size in (32, 48, (64, 64)):
        image = render(scene, size)
        side = size if isinstance(size, int) else size[0]
        assert image.shape == (side, side, 3) and image.dtype == np.uint8
        assert tuple(image[0, 0]) == BACKGROUND


@pytest.mark.parametrize("size", [0, 8, -32, 32.5, "64", True, (32, 64), (32,)])
def test_render_rejects_bad_sizes(size):
    scene = scene_for(parse_prompt("a circle"), np.random.default_rng(13))
    with pytest.raises(ValueError, match="size"):
        render(scene, size)

"""The strict held-out metric beside the GenEval-style one, and its bootstrap intervals."""

import numpy as np
import pytest

from flowloop.tasks import ShapesTask
from flowloop.tasks.shapes import CATEGORIES, Scene, SceneObject, parse_prompt, render, sample_scene, verify
from flowloop.tasks.shapes.bootstrap import bootstrap_accuracy
from flowloop.tasks.shapes.task import score_images


def _scene(prompt: str, *objects: tuple[str, str, tuple[float, float]]) -> np.ndarray:
    """uint8 ``[32, 32, 3]``: the given (shape, colour, centre) objects, well apart."""
    placed = tuple(SceneObject(shape, colour, centre, 0.14) for shape, colour, centre in objects)
    return render(Scene(None, parse_prompt(prompt), placed), size=32)


PERFECT = _scene("two triangles", ("triangle", "red", (0.25, 0.35)), ("triangle", "blue", (0.75, 0.75)))
SURPLUS = {  # GenEval-correct pictures with one object too many
    "a square": _scene("a square", ("square", "green", (0.25, 0.25)), ("square", "green", (0.72, 0.72))),
    "two triangles": _scene("two triangles", ("triangle", "red", (0.25, 0.35)), ("triangle", "blue", (0.75, 0.75)),
                            ("circle", "yellow", (0.72, 0.25))),
}


NEW_SHAPES_SURPLUS = {  # the same with the shapes added to the world (star, diamond, cross)
    "one black star": _scene("one black star", ("star", "black", (0.3, 0.3)), ("cross", "black", (0.72, 0.72))),
    "three diamonds": _scene("three diamonds", ("diamond", "red", (0.25, 0.25)), ("diamond", "cyan", (0.75, 0.25)),
                             ("diamond", "pink", (0.25, 0.75)), ("star", "blue", (0.75, 0.75))),
    "a red cross and a pink cross": _scene("a red cross and a pink cross", ("cross", "red", (0.25, 0.3)),
                                           ("cross", "pink", (0.75, 0.3)), ("cross", "pink", (0.5, 0.75))),
}


@pytest.mark.parametrize("prompt", list(NEW_SHAPES_SURPLUS))
def test_a_surplus_object_among_the_new_shapes_is_strict_wrong(prompt):
    verdict = verify(NEW_SHAPES_SURPLUS[prompt], prompt)
    assert verdict.correct and verdict.surplus_objects == 1 and not verdict.strict
    assert {o["shape"] for o in verdict.details["objects"]} <= {"star", "diamond", "cross"}


@pytest.mark.parametrize("prompt", list(SURPLUS))
def test_a_surplus_object_is_geneval_correct_but_strict_wrong(prompt):
    verdict = verify(SURPLUS[prompt], prompt)
    assert verdict.correct and verdict.score == 1.0
    assert verdict.surplus_objects == 1 and not verdict.exact_count and not verdict.strict


def test_a_perfect_scene_is_correct_both_ways():
    verdict = verify(PERFECT, "two triangles")
    assert verdict.correct and verdict.strict and verdict.surplus_objects == 0


def test_a_missing_object_is_wrong_both_ways():
    verdict = verify(_scene("a circle and a square", ("circle", "red", (0.3, 0.3))), "a circle and a square")
    assert not verdict.correct and not verdict.strict and verdict.surplus_objects == -1


def test_eval_result_reports_both_accuracies_per_category_with_n():
    images = np.stack([PERFECT, SURPLUS["two triangles"], SURPLUS["a square"]])
    prompts = ["two triangles", "two triangles", "a square"]
    result, verdicts = score_images(images, prompts, ["counting", "counting", "single_object"])
    assert [v.strict for v in verdicts] == [True, False, False]
    assert result.per_category["counting"] == {"accuracy": 1.0, "strict_accuracy": 0.5, "score": 1.0, "n": 2}
    assert result.per_category["single_object"]["strict_accuracy"] == 0.0
    assert result.accuracy == result.geneval.category_mean == 1.0
    assert result.strict_accuracy == pytest.approx(0.25) and result.strict.sample_mean == pytest.approx(1 / 3)
    out = result.as_dict()
    assert out["strict"]["category_mean_ci"][0] <= 0.25 <= out["strict"]["category_mean_ci"][1]
    assert out["bootstrap"]["resamples"] == 2000 and out["n"] == 3


def test_validation_logs_strict_beside_an_unchanged_accuracy():
    task = ShapesTask(val_per_category=4)
    rng = np.random.default_rng(0)
    rows, images = [], []
    for category in CATEGORIES:
        for _ in range(4):
            scene = sample_scene(rng, split="heldout", category=category)
            rows.append({"raw_prompt": scene.prompt, "category": category})
            images.append(render(scene, size=32))
    rows.append({"raw_prompt": "two triangles", "category": "counting"})
    images.append(SURPLUS["two triangles"])
    metrics, _ = task.evaluate(np.stack(images), rows)
    verdicts = [verify(image, row["raw_prompt"]) for image, row in zip(images, rows)]
    per_category = {c: np.mean([v.correct for v, r in zip(verdicts, rows) if r["category"] == c]) for c in CATEGORIES}
    assert metrics["val/accuracy"] == np.mean([per_category[c] for c in sorted(CATEGORIES)])  # today's formula
    assert metrics["val/counting/strict_accuracy"] < metrics["val/counting/accuracy"]
    assert metrics["val/strict_accuracy"] < metrics["val/accuracy"]
    assert {f"val/{c}/strict_accuracy" for c in CATEGORIES} < set(metrics)
    assert ShapesTask.val_metric == "val/strict_accuracy"


def _verdicts(n_per_category: int, seed: int = 0) -> tuple[list[bool], list[str]]:
    rng = np.random.default_rng(seed)
    rates = {"a": 0.2, "b": 0.5, "c": 0.9}
    categories = [c for c in rates for _ in range(n_per_category)]
    return [bool(rng.random() < rates[c]) for c in categories], categories


def test_bootstrap_interval_holds_the_estimate_and_narrows_with_more_samples():
    widths = []
    for n in (20, 80, 320):
        correct, categories = _verdicts(n)
        acc = bootstrap_accuracy(correct, categories)
        for value, (low, high) in [(acc.category_mean, acc.category_mean_ci), (acc.sample_mean, acc.sample_mean_ci)]:
            assert 0.0 <= low <= value <= high <= 1.0
        widths.append(acc.category_mean_ci[1] - acc.category_mean_ci[0])
    assert widths[0] > widths[1] > widths[2] > 0.0


def test_bootstrap_is_reproducible_with_its_seed_and_stratified():
    correct, categories = _verdicts(30)
    first = bootstrap_accuracy(correct, categories, seed=7)
    assert bootstrap_accuracy(correct, categories, seed=7) == first
    assert bootstrap_accuracy(correct, categories, seed=8).category_mean_ci != first.category_mean_ci
    # Unbalanced categories: the category mean weighs each alike, the sample mean each sample.
    acc = bootstrap_accuracy([True] * 9 + [False], ["a"] * 9 + ["b"])
    assert acc.category_mean == 0.5 and acc.sample_mean == 0.9
    assert acc.category_mean_ci == (0.5, 0.5)  # every category's verdicts alike: nothing to resample


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        bootstrap_accuracy([True], ["a", "b"])
    with pytest.raises(ValueError, match="at least one sample"):
        bootstrap_accuracy([], [])
    with pytest.raises(ValueError, match="resamples must be >= 1"):
        bootstrap_accuracy([True], ["a"], resamples=0)

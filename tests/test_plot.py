"""`flowloop plot`: per-category training curves as trailing means, and the PNG from a real metrics file."""

import json

import pytest
from PIL import Image

from flowloop.cli import main
from flowloop.plot import category_training_series


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_category_series_are_trailing_means_over_the_steps_a_category_was_drawn():
    rows = [
        {"step": 1, "reward/category/counting/correct": 0.0, "reward/category/counting/mean": 0.5},
        {"step": 2, "reward/category/position/mean": 0.25},
        {"step": 3, "reward/category/counting/correct": 1.0, "reward/category/counting/mean": 1.0},
        {"step": 4, "reward/category/counting/correct": 0.5, "reward/category/counting/mean": 0.75},
    ]
    series = category_training_series(rows, window=2)
    assert series["counting"] == ([1, 3, 4], [0.0, 0.5, 0.75])  # accuracy where the reward reports it
    assert series["position"] == ([2], [0.25])  # the mean reward where it does not


@pytest.mark.parametrize("strict", [False, True])  # runs before the strict metric, and today's
def test_plot_writes_a_png_from_a_run_folder(tmp_path, capsys, strict):
    rows = [{"step": 0, "val/accuracy": 0.5, "val/counting/accuracy": 0.4, "val/position/accuracy": 0.6}]
    for step in range(1, 21):
        rows.append({"step": step, "reward/mean": 0.5 + step / 100, "reward/correct": step / 40,
                     "reward/category/counting/correct": step / 20, "reward/category/position/correct": 1 - step / 20})
    rows.append({"step": 20, "val/accuracy": 0.7, "val/counting/accuracy": 0.8, "val/position/accuracy": 0.6})
    if strict:
        for row in (rows[0], rows[-1]):
            row.update({f"val/{k.removeprefix('val/').replace('accuracy', 'strict_accuracy')}": v - 0.1
                        for k, v in list(row.items()) if k.endswith("accuracy")})
    write_metrics(tmp_path / "run", rows)
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "curve.png"
    assert str(png) in capsys.readouterr().out
    with Image.open(png) as image:
        assert image.size == (1100, 440)


def test_plot_of_a_folder_without_metrics_names_the_file(tmp_path):
    from flowloop.plot import plot_run

    with pytest.raises(FileNotFoundError, match="metrics.jsonl is missing"):
        plot_run(tmp_path)


def test_trailing_mean_uses_fewer_values_at_the_start():
    from flowloop.plot import trailing_mean

    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 3) == [1.0, 2.0, 3.0, 5.0]


@pytest.mark.parametrize("algo, actor, expected", [
    (None, None, ("SDE", "flow_grpo")),  # no config.yaml: the defaults
    ({"sampler": "sde", "noise_level": 1.0}, {}, ("SDE", "flow_grpo")),
    ({"sampler": "cps", "noise_level": 0.5}, {"objective": "flow_grpo"}, ("CPS", "flow_grpo")),
    ({"sampler": "ode"}, {"objective": "nft"}, ("ODE", "nft")),
    ({"sampler": "sde", "noise_level": 0.0}, {"objective": "nft"}, ("ODE", "nft")),  # zero noise is the Euler step
])
def test_the_panels_name_the_rollout_sampler_and_objective_from_the_run_config(tmp_path, algo, actor, expected):
    from omegaconf import OmegaConf

    from flowloop.plot import rollout_sampler_and_objective

    if algo is not None:
        OmegaConf.save(OmegaConf.create({"rollout": {"algo": algo}, "actor": actor}), tmp_path / "config.yaml")
    assert rollout_sampler_and_objective(tmp_path) == expected

"""metrics.jsonl (values, truncation on resume, no silent reuse), optional backends and the
progress line."""

import io
import json
import sys

import numpy as np
import pytest
import torch

from flowloop.trainer.metrics_log import MetricsLogger, ProgressLine, flatten_metrics, read_metrics


def test_values_are_flattened_and_written_one_line_per_step(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"reward": torch.tensor(0.5), "n": np.int64(3), "eval": {"accuracy": 0.25}, "loss": float("nan")})
        # Flushed as written: readable before close.
        assert read_metrics(tmp_path)[0]["reward"] == 0.5
    (record,) = read_metrics(tmp_path)
    assert {k: v for k, v in record.items() if k != "time"} == {
        "step": 1, "reward": 0.5, "n": 3, "eval/accuracy": 0.25, "loss": None,
    }
    with pytest.raises(ValueError, match="metric 'bad' must be a number, got str"):
        flatten_metrics({"bad": "x"})
    with pytest.raises(ValueError, match="metric 'v' must be a number, got a tensor of shape"):
        flatten_metrics({"v": torch.ones(2)})


def test_resume_truncates_later_lines_so_no_step_appears_twice(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 6):
            log.log(step, {"reward": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # a line torn by a crash

    # The checkpoint is at step 3: steps 4, 5 and the torn line are dropped, then 4.. rewritten.
    with MetricsLogger(tmp_path, resume_step=3) as log:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        for step in range(4, 7):
            log.log(step, {"reward": step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["reward"] for r in records] == [0.1, 0.2, 0.3, 4, 5, 6]


def test_a_new_run_refuses_an_existing_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="already exists: pass resume_step"):
        MetricsLogger(tmp_path)
    assert read_metrics(tmp_path) == [{"step": 1}]


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_missing_backend_names_the_extra(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # the import fails for real
    with pytest.raises(ImportError, match=rf"pip install 'flowloop\[{backend}\]'"):
        MetricsLogger(tmp_path, **{backend: True})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log(1, {"reward": 0.5, "eval": {"accuracy": 0.25}})
        log.log(2, {"reward": 0.75})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    assert events.Scalars("eval/accuracy")[0].value == 0.25


def test_validation_grids_go_to_tensorboard_as_images(tmp_path):
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid = np.zeros((24, 40, 3), dtype=np.uint8)
    grid[:, :20, 0] = 255
    Image.fromarray(grid).save(tmp_path / "grid.png")
    with MetricsLogger(tmp_path / "run", tensorboard=True) as log:
        log.log_image(0, "val/grid", tmp_path / "grid.png")  # the PNG the recipe saves
        log.log_image(2, "val/grid", grid)
        with pytest.raises(ValueError, match="uint8"):
            log.log_image(3, "val/grid", grid.astype(np.float32))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert "val/grid" in events.Tags()["images"]
    images = events.Images("val/grid")
    assert [(e.step, e.width, e.height) for e in images] == [(0, 40, 24), (2, 40, 24)]
    decoded = np.asarray(Image.open(io.BytesIO(images[0].encoded_image_string)).convert("RGB"))
    assert np.array_equal(decoded, grid)


def test_wandb_gets_the_run_config_project_and_grids(tmp_path, monkeypatch):
    """Offline (no network, no account); runs only where wandb is installed."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer:\n  wandb_project: my-project\n  seed: 3\n")
    with MetricsLogger(run_dir, wandb=True) as log:
        run = log._wandb
        assert run.project == "my-project" and run.config["trainer"]["seed"] == 3
        log.log(1, {"reward": 0.5})
        log.log_image(1, "val/grid", np.zeros((8, 8, 3), dtype=np.uint8))
    assert (run_dir / "wandb_id.txt").read_text().strip() == run.id
    assert wandb.run is None


def test_progress_line_shows_step_reward_accuracy_time_and_eta():
    out = io.StringIO()
    line = ProgressLine(total_steps=10, start_step=2, file=out)
    assert line.update(3, reward=0.5, accuracy=0.25, step_time=2.0) == (
        "step 3/10 | reward 0.500 | acc 0.250 | 2.00 s/step | ETA 00:14"
    )
    # accuracy stays until the next evaluation; ETA = mean step time (3 s) * 6 steps left
    assert line.update(4, reward=0.625, step_time=4.0) == (
        "step 4/10 | reward 0.625 | acc 0.250 | 4.00 s/step | ETA 00:18"
    )
    line.close()
    assert "step 4/10" in out.getvalue()

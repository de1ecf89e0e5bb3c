"""Checkpoints: a full round trip (weights bitwise, optimizer, schedulers, RNG draws, data state),
broken checkpoints skipped, pruning, resume resolution, and run folders never reused."""

import json
import logging
import random

import numpy as np
import pytest
import torch

from flowloop.trainer.checkpoint import (
    capture_rng_state,
    latest_valid_checkpoint,
    load_checkpoint,
    new_run_dir,
    resolve_resume,
    restore_rng_state,
    save_checkpoint,
)


def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def _trained_model(seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _save(run_dir, step, **kwargs):
    return save_checkpoint(run_dir, step, {"w": torch.full((2, 2), float(step))}, **kwargs)


def test_round_trip_restores_weights_optimizer_scheduler_rng_and_data(tmp_path):
    model, optimizer, scheduler = _trained_model()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = {i: s["exp_avg"].clone() for i, s in enumerate(optimizer.state_dict()["state"].values())}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    rng = capture_rng_state()
    path = save_checkpoint(
        tmp_path, 7, model.state_dict(), optimizer, [scheduler], rng,
        data_state={"epoch": 1, "index": 42}, extra={"tracker": {"history": {"a red circle": [0.5, 1.0]}}},
    )
    expected_draws = _draws()
    assert path == tmp_path / "checkpoints" / "step_000007"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer.pt", "schedulers.pt", "state.pt",
    ]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000007"]  # no temp folder left

    # Change everything, then load into fresh objects.
    _draws()
    fresh, fresh_opt, fresh_sched = _trained_model(seed=5, steps=1)  # other weights, moments, lr
    ckpt = load_checkpoint(path, optimizer=fresh_opt, schedulers=[fresh_sched])
    fresh.load_state_dict(ckpt.model_state)
    restore_rng_state(ckpt.rng_state)

    assert ckpt.step == 7
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, weights[key]), key  # bitwise
    for i, state in enumerate(fresh_opt.state_dict()["state"].values()):
        assert torch.equal(state["exp_avg"], exp_avg[i])
        assert state["step"].item() == 3
    assert fresh_sched.last_epoch == 3 and fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert _draws() == expected_draws
    assert ckpt.data_state == {"epoch": 1, "index": 42}
    assert ckpt.extra["tracker"]["history"]["a red circle"] == [0.5, 1.0]


def test_tied_weights_and_views_are_saved(tmp_path):
    shared = torch.arange(6.0)
    path = save_checkpoint(tmp_path, 0, {"a": shared, "b": shared, "c": shared[2:4]})
    state = load_checkpoint(path).model_state
    assert state["b"].tolist() == shared.tolist() and state["c"].tolist() == [2.0, 3.0]


def test_broken_checkpoints_are_skipped_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    root = tmp_path / "checkpoints"
    # step 3: a weight file corrupted in place (same size, one byte changed).
    weights = root / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    # step 4: an empty folder; a leftover temp folder from a crashed write.
    (root / "step_000004").mkdir()
    (root / ".step_000005.abc.tmp").mkdir()

    with caplog.at_level(logging.WARNING, logger="flowloop.trainer.checkpoint"):
        assert latest_valid_checkpoint(tmp_path) == root / "step_000002"
    assert "step_000004: no manifest.json" in caplog.text
    assert "step_000003: model.safetensors does not match its sha256" in caplog.text
    with pytest.raises(ValueError, match="not a valid checkpoint: model.safetensors does not match"):
        load_checkpoint(root / "step_000003")

    # A checkpoint whose manifest never got written (an incomplete write) is not valid either.
    (root / "step_000002" / "manifest.json").unlink()
    assert latest_valid_checkpoint(tmp_path) == root / "step_000001"
    assert resolve_resume(tmp_path, "auto") == root / "step_000001"


def test_keep_last_prunes_old_checkpoints_and_a_step_can_be_rewritten(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    save_checkpoint(tmp_path, 4, {"w": torch.zeros(1)}, extra={"again": True})
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "step_000004")
    assert ckpt.extra == {"again": True} and ckpt.model_state["w"].tolist() == [0.0]
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2


def test_non_plain_state_is_refused_at_save_time(tmp_path):
    with pytest.raises(ValueError, match=r"extra\['tracker'\] is a deque"):
        _save(tmp_path, 1, extra={"tracker": __import__("collections").deque([1.0])})
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 1, keep_last=0)
    assert latest_valid_checkpoint(tmp_path) is None


def test_resolve_resume(tmp_path):
    run = tmp_path / "run"
    assert resolve_resume(run, "auto") is None  # nothing yet: start fresh
    assert resolve_resume(run, "never") is None
    first = _save(run, 1)
    second = _save(run, 2)
    assert resolve_resume(run, "auto") == second
    assert resolve_resume(run, str(first)) == first
    assert resolve_resume(tmp_path / "other", run) == second  # a run folder: its newest checkpoint
    with pytest.raises(ValueError, match="resume=never but .* already holds checkpoints"):
        resolve_resume(run, "never")
    with pytest.raises(ValueError, match="resume must be 'auto', 'never' or the path"):
        resolve_resume(run, "latest")
    for path in (first, second):
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["files"]["state.pt"]["bytes"] += 1
        (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"no valid checkpoint .* \(broken: step_000001, step_000002\)"):
        resolve_resume(run, "auto")
    with pytest.raises(ValueError, match="is not a valid checkpoint: state.pt has"):
        resolve_resume(run, str(first))


def test_new_run_dir_never_reuses_a_folder(tmp_path):
    first = new_run_dir(tmp_path, "shapes")
    (first / "metrics.jsonl").write_text("{}\n")
    second = new_run_dir(tmp_path, "shapes")
    third = new_run_dir(tmp_path, "shapes")
    assert [first.name, second.name, third.name] == ["shapes", "shapes-1", "shapes-2"]
    assert (first / "metrics.jsonl").read_text() == "{}\n"
    assert not any(second.iterdir())
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="plain folder name"):
            new_run_dir(tmp_path, bad)

"""Run folders under faults: what a resume may change, one process per folder, leftovers of kills."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from flowloop.trainer.recipe import RLRecipe, run
from flowloop.trainer.run_folder import LOCK_FILE, RunLock, clean_stale_temporaries
from tests.trainer.test_recipe import metrics, tiny_config

quiet = dict(log=lambda _: None)


def test_a_resume_that_cannot_apply_names_the_keys_and_leaves_the_run_as_it_was(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2"), **quiet)
    record = (tmp_path / "shapes" / "config.yaml").read_bytes()
    with pytest.raises(ValueError) as err:
        run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=4", "trainer.resume=auto",
                        "actor.finetune=lora", "actor.lora_rank=4"), **quiet)
    message = str(err.value)
    assert "actor.finetune='lora' (run: 'full')" in message and "actor.lora_rank=4 (run: 16)" in message
    assert "start a new run (trainer.resume=never)" in message
    assert (tmp_path / "shapes" / "config.yaml").read_bytes() == record
    assert sorted(p.name for p in (tmp_path / "shapes" / "checkpoints").iterdir()) == ["step_000002"]
    with pytest.raises(ValueError, match="actor.warmup_steps=3 \\(run: 0\\): the schedule comes back"):
        run(tiny_config(tiny_model_dir, tmp_path, "trainer.resume=auto", "actor.warmup_steps=3"), **quiet)


def test_a_changed_lr_on_resume_is_what_the_optimizer_uses(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2"), **quiet)
    logged = []
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=3", "trainer.resume=auto", "actor.lr=5e-4",
                    "trainer.val_every=5"), log=logged.append)
    assert any("actor.lr: 0.001 -> 0.0005" in line for line in logged)
    lrs = [r["actor/lr"] for r in metrics(tmp_path / "shapes") if "actor/lr" in r]
    assert lrs == pytest.approx([1e-3, 1e-3, 5e-4])
    assert "lr: 0.0005" in (tmp_path / "shapes" / "config.yaml").read_text()


def test_two_processes_cannot_train_into_one_folder_and_a_dead_ones_lock_is_taken_over(tiny_model_dir, tmp_path, caplog):
    first = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1"), **quiet)
    first.setup()
    try:
        second = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.resume=auto"), **quiet)
        with pytest.raises(ValueError, match=f"in use by pid {os.getpid()} on .*lock file .*{LOCK_FILE}"):
            second.setup()
    finally:
        first.cleanup()
    # A process killed while holding the lock: its file stays, its flock dies with it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / LOCK_FILE).write_text(f"pid {dead.pid} on somewhere\n")
    with caplog.at_level("WARNING"), RunLock(tmp_path / "other"):
        assert f"pid {os.getpid()}" in (tmp_path / "other" / LOCK_FILE).read_text()
    assert f"taking over the lock of pid {dead.pid}" in caplog.text


def test_resume_auto_without_a_checkpoint_starts_that_folder_over(tiny_model_dir, tmp_path):
    root = tmp_path / "runs"
    (root / "shapes").mkdir(parents=True)
    (root / "shapes" / "metrics.jsonl").write_text('{"step": 0, "val/accuracy": 0.5}\n')
    (root / "shapes" / "checkpoints" / ".step_000002.abc.tmp").mkdir(parents=True)
    run(tiny_config(tiny_model_dir, root, "trainer.total_steps=2", "trainer.resume=auto"), **quiet)
    assert sorted(p.name for p in root.iterdir()) == ["shapes"]
    assert sorted(p.name for p in (root / "shapes" / "checkpoints").iterdir()) == ["step_000002"]
    assert [r["step"] for r in metrics(root / "shapes")] == [0, 1, 2]
    run(tiny_config(tiny_model_dir, tmp_path / "straight", "trainer.total_steps=2"), **quiet)
    same = load_file(root / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    straight = load_file(tmp_path / "straight" / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    assert all(torch.equal(same[k], straight[k]) for k in same)


def test_stale_checkpoint_temporaries_are_removed(tmp_path):
    parent = tmp_path / "checkpoints"
    (parent / ".step_000004.x1.tmp").mkdir(parents=True)
    (parent / ".step_000002.x2.old").mkdir()
    (parent / "step_000002").mkdir()
    assert len(clean_stale_temporaries(tmp_path)) == 2
    assert [p.name for p in parent.iterdir()] == ["step_000002"]


def test_a_failed_start_leaves_no_run_folder(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="lora_target_modules"):
        run(tiny_config(tiny_model_dir, tmp_path / "runs", "actor.finetune=lora", "actor.lora_target_modules=[nothing]"), **quiet)
    assert list((tmp_path / "runs").iterdir()) == []

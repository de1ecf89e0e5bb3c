"""Fault-injection soak: 100 steps killed with SIGKILL every 20, a reward that fails every 15 and a
corrupted checkpoint, each time resumed with trainer.resume=auto, end exactly where an
uninterrupted run ends (weights bit for bit, metrics equal, every step logged once)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowloop.reward.registry import register_reward
from flowloop.trainer.recipe import run
from tests.trainer.test_recipe import brightness, metrics, tiny_config

REPO = Path(__file__).resolve().parents[2]
ARGS = ("trainer.total_steps=100", "trainer.save_every=5", "trainer.val_every=50")


@register_reward("test_soak_flaky")
def flaky(images, prompts, metadata):
    """Brightness; the first attempt at every 15th step fails (``SOAK_DIR`` keeps the attempts)."""
    uid = str(metadata[0].get("uid", ""))
    folder = os.environ.get("SOAK_DIR")
    if folder and not uid.startswith("val"):
        step = int(uid.split("-")[0])
        marker = Path(folder) / f"failed_{step}"
        if step % 15 == 0 and not marker.exists():
            marker.touch()
            raise ConnectionError(f"reward server lost at step {step}")
    return brightness(images, prompts, metadata)


def _logged_steps(path: Path) -> list[int]:
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return steps


@pytest.mark.slow
def test_kills_failed_rewards_and_a_corrupted_checkpoint_change_nothing(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path / "straight", *ARGS, "rollout.reward.name=test_brightness"), log=lambda _: None)
    root = tmp_path / "soak"
    child = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import tests.trainer.test_soak; "
             f"from tests.trainer.test_recipe import tiny_config; from flowloop.trainer.recipe import run; "
             f"run(tiny_config({str(tiny_model_dir)!r}, {str(root)!r}, *{ARGS!r}, 'trainer.resume=auto', "
             f"'rollout.reward.name=test_soak_flaky'), log=lambda _: None)")
    env = {**os.environ, "SOAK_DIR": str(tmp_path)}
    kills, corrupted, starts = [20, 40, 60, 80], False, 0
    while True:
        starts += 1
        assert starts < 30, "the soak does not converge"
        proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            if kills and max(_logged_steps(root / "shapes" / "metrics.jsonl"), default=0) >= kills[0]:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills.pop(0)
                if not corrupted:  # the newest checkpoint goes bad: resume falls back to the one before
                    newest = sorted((root / "shapes" / "checkpoints").glob("step_*"))[-1] / "model.safetensors"
                    data = bytearray(newest.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    newest.write_bytes(bytes(data))
                    corrupted = True
                break
            time.sleep(0.02)
        if proc.returncode == 0:
            break
    assert starts >= 11 and not kills and corrupted and all((tmp_path / f"failed_{s}").exists() for s in (15, 30, 45, 60, 75, 90))
    straight = load_file(tmp_path / "straight" / "shapes" / "checkpoints" / "step_000100" / "model.safetensors")
    soaked = load_file(root / "shapes" / "checkpoints" / "step_000100" / "model.safetensors")
    assert all(torch.equal(straight[k], soaked[k]) for k in straight)
    assert metrics(tmp_path / "straight" / "shapes") == metrics(root / "shapes")
    assert _logged_steps(root / "shapes" / "metrics.jsonl") == list(range(101))

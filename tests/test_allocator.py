"""Allocator tuning: steady-state forwards stop faulting in fresh pages, and results do not change."""

import json
import os
import subprocess
import sys

import pytest

from flowloop.allocator import keep_freed_memory

PROBE = r"""
import json, resource, sys, torch
from flowloop.allocator import keep_freed_memory
applied = keep_freed_memory()  # what `flowloop` commands do first (flowloop.cli.main)
from flowloop.rollout import RolloutEngine
from flowloop.models import load_flow_model
from flowloop.tasks import shapes
model = load_flow_model()
engine = RolloutEngine(model)
dit = model.trainable_module().eval()
ids, mask = model.tokenize(shapes.split_prompts("train")[:1])
b = 16
with torch.no_grad():
    text = model.text_encoder(ids, mask)
    x = (torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.full((b,), 0.5),
         text.expand(b, -1, -1).contiguous(), mask.expand(b, -1).contiguous())
    for _ in range(3):
        dit(*x)
    rounds = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            out = dit(*x)
        rounds.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
    faults = min(rounds)  # steady state: the quietest round
print(json.dumps({"applied": applied, "faults": faults, "out": out.flatten()[::97].tolist()}))
"""


def probe(tuning: str, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "FLOWLOOP_MALLOC_TUNING": tuning, **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not glibc(), reason="mallopt settings are glibc's")
def test_tuned_forwards_take_no_page_faults_and_give_the_same_bits():
    tuned, plain = probe("1"), probe("0")
    assert tuned["applied"] is True and plain["applied"] is False
    assert tuned["faults"] < 20, tuned["faults"]  # untuned: thousands a forward here
    assert tuned["out"] == plain["out"]  # where memory comes from never changes a result


def test_switched_off_by_the_environment(monkeypatch):
    from flowloop import allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("FLOWLOOP_MALLOC_TUNING", "0")
    assert keep_freed_memory() is False


@pytest.mark.skipif(not glibc(), reason="mallopt settings are glibc's")
def test_a_child_given_malloc_env_runs_as_tuned_without_calling_mallopt(monkeypatch):
    """What a Ray actor of a tuned driver gets (`make_actor` passes `malloc_env`)."""
    from flowloop import allocator

    monkeypatch.setattr(allocator, "_applied", True)
    env = allocator.malloc_env()
    assert set(env) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}
    child = probe("0", env)
    assert child["applied"] is False and child["faults"] < 20, child["faults"]
    monkeypatch.setattr(allocator, "_applied", False)
    assert allocator.malloc_env() == {}

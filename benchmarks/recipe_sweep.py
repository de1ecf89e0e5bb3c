"""Run several `flowloop train` configurations side by side and tabulate strict held-out accuracy.

    python benchmarks/recipe_sweep.py --minutes 8 --out runs/sweep \
        --base "model.device=cuda trainer.total_steps=300" \
        --variant "lr1e-5: actor.lr=1e-5" --variant "lr3e-5: actor.lr=3e-5"

Each variant is one subprocess (``trainer.num_threads=2``), stopped after ``--minutes`` (its
``metrics.jsonl`` is written every step, so a stopped run still reports). Prints, per variant:
steps done, seconds per step, held-out accuracy before, best (and at which step), and last.
``--eval`` then runs ``flowloop eval --split heldout`` on each variant's newest checkpoint and
those of the RL steps named by ``--eval-at`` (with the run's ``model.path``; all at once, 2
threads each, sampling on ``--eval-device``; 8 seeds per prompt) at each ``--eval-steps`` ODE
step count (default 40), writes ``OUT/NAME/eval_step_N_odeS.json`` and prints overall and
per-category strict accuracy. Seeds are variants too: ``--variant "s1: trainer.seed=1"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from flowloop.plot import read_rows
from flowloop.tasks.shapes.task import ShapesTask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--base", default="", help="overrides shared by every variant")
    parser.add_argument("--variant", action="append", required=True, help='"name: key=value key=value"')
    parser.add_argument("--eval", action="store_true", help="evaluate each variant's newest checkpoint on the held-out split")
    parser.add_argument("--eval-device", default="cpu", help="where the evaluations sample: cpu or cuda")
    parser.add_argument("--eval-at", type=int, nargs="+", default=[],
                        help="also evaluate these RL steps' checkpoints (needs trainer.keep_last=null in --base)")
    parser.add_argument("--eval-steps", type=int, nargs="+", default=[40], help="ODE step counts to evaluate at (one eval each)")
    args = parser.parse_args()
    variants = [(name.strip(), overrides) for name, _, overrides in (spec.partition(":") for spec in args.variant)]
    try:
        check_fresh(Path(args.out), [name for name, _ in variants])
    except ValueError as error:
        parser.error(str(error))
    procs = {}
    for name, overrides in variants:
        cmd = [sys.executable, "-m", "flowloop.cli", "train", *options_first(shlex.split(args.base) + shlex.split(overrides)),
               f"trainer.run_root={args.out}", f"trainer.run_name={name}", "trainer.num_threads=2"]
        log = open(Path(args.out).mkdir(parents=True, exist_ok=True) or Path(args.out) / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.time() + 60 * args.minutes
    while time.time() < deadline and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(5)
    for proc, log in procs.values():
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        log.close()
    print(f"{'variant':<14} {'steps':>5} {'s/step':>7} {'before':>7} {'best':>7} {'@step':>6} {'last':>7}")
    for name in procs:
        path = Path(args.out) / name / "metrics.jsonl"
        rows = read_rows(path) if path.exists() else []  # a run stopped mid-write leaves a torn last line
        val = [(r["step"], r[ShapesTask.val_metric]) for r in rows if r.get(ShapesTask.val_metric) is not None]
        steps = [r for r in rows if r.get("time/step")]
        if not val:
            print(f"{name:<14} no validation yet (see {args.out}/{name}.log)")
            continue
        best = max(val, key=lambda sv: sv[1])
        per_step = sum(r["time/step"] for r in steps) / max(len(steps), 1)
        print(f"{name:<14} {len(steps):>5} {per_step:>7.2f} {val[0][1]:>7.1%} {best[1]:>7.1%} {best[0]:>6} {val[-1][1]:>7.1%}")
    if args.eval:
        evaluate_checkpoints(Path(args.out), list(procs), args.eval_steps, args.eval_device, args.eval_at)


def check_fresh(out: Path, names: list[str]) -> None:
    """ValueError unless every variant name is new, in this sweep and under ``out``: a variant
    whose run folder already exists would fail to start, and the table would show the old run's
    metrics as this sweep's."""
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--variant names {repeated} more than once; give each variant its own name")
    existing = [name for name in names if (out / name).exists()]
    if existing:
        raise ValueError(f"--out {out} already holds runs named {existing} (an earlier sweep's): pass a new "
                         f"--out, or remove {', '.join(str(out / name) for name in existing)}")


def options_first(tokens: list[str]) -> list[str]:
    """``--option [value]`` moved before the ``key=value`` overrides, so a variant can name its own
    ``--recipe`` after the shared overrides (argparse takes no option after the positionals). A
    token with ``=`` is always an override, never an option's value."""
    options, overrides, i = [], [], 0
    while i < len(tokens):
        if tokens[i].startswith("--"):
            following = tokens[i + 1] if i + 1 < len(tokens) else "--"
            takes_value = "=" not in tokens[i] and not following.startswith("--") and "=" not in following
            options += tokens[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            overrides.append(tokens[i])
            i += 1
    return options + overrides


def evaluate_checkpoints(out: Path, names: list[str], step_counts: list[int], device: str = "cpu",
                         rl_steps: list[int] = ()) -> None:
    """`flowloop eval` of each run's newest checkpoint (and those of ``rl_steps`` that exist) at each
    ODE step count, all in parallel on ``device``; one row each."""
    jobs = {}
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for name in names:
        checkpoints = sorted((out / name / "checkpoints").glob("step_*"))
        if not checkpoints:
            print(f"{name:<14} no checkpoint to evaluate")
            continue
        chosen = [c for c in checkpoints if int(c.name.removeprefix("step_")) in rl_steps and c != checkpoints[-1]]
        model_path = OmegaConf.load(out / name / "config.yaml").model.path  # the run's own base model
        for checkpoint, steps in [(c, s) for c in [*chosen, checkpoints[-1]] for s in step_counts]:
            result = out / name / f"eval_{checkpoint.name}_ode{steps}.json"
            cmd = [sys.executable, "-m", "flowloop.cli", "eval", "--split", "heldout", "--steps", str(steps),
                   "--checkpoint", str(checkpoint), "--json", str(result), "--device", device]
            if model_path:
                cmd += ["--model", str(model_path)]
            log = open(out / f"{name}.eval_{checkpoint.name}_ode{steps}.log", "w")
            jobs[result] = (name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    for result, (name, proc, log) in jobs.items():
        proc.wait()
        log.close()
        if proc.returncode:
            print(f"{name:<14} eval failed (see {log.name})")
            continue
        report = json.loads(result.read_text())
        categories = "  ".join(f"{c} {v['strict_accuracy']:.1%}" for c, v in report["per_category"].items())
        print(f"{name:<14} {result.stem.removeprefix('eval_'):<18} held-out strict {report['strict_accuracy']:.1%}"
              f" (GenEval-style {report['accuracy']:.1%})  {categories}")


if __name__ == "__main__":
    main()

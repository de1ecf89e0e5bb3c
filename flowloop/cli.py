"""`flowloop` command line: train, eval, generate, export, plot, pretrain, serve-reward.

Each command prints what it does, shows a progress bar on long work, and turns bad input
into a one-line error (exit code 2) that names the field and the fix (`main`; ``--debug`` shows
the traceback instead). Output paths are checked before any work, so no result is lost to them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from flowloop.allocator import keep_freed_memory
from flowloop.config import DEFAULT_RECIPE as DEFAULT_RECIPE_NAME
from flowloop.config import recipe_names, recipe_path

DEFAULT_SEED = 0
DEFAULT_RECIPE = recipe_path(DEFAULT_RECIPE_NAME)


def _positive(value: str) -> int:
    """argparse type: an int >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _finite(value: str) -> float:
    """argparse type: a finite float."""
    number = float(value)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return number


def _progress(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True, file=sys.stderr)
    return bar, bar.update


def cmd_pretrain(args) -> None:
    from flowloop.config import load_config
    from flowloop.trainer.pretrain import PretrainConfig, pretrain

    cfg = load_config(PretrainConfig, args.overrides)
    out = pretrain(cfg, log=lambda msg: print(msg, flush=True))
    print(f"model saved to {out / 'model'} (checkpoints in {out / 'checkpoints'})")


def train_config(args):
    """The run's config: the recipe (``--recipe``; the default one unless only ``--config`` is
    given), then the user's ``--config`` file, then ``key=value`` overrides."""
    from flowloop.config import load_config
    from flowloop.config.train import TrainConfig

    files = [recipe_path(args.recipe or DEFAULT_RECIPE_NAME)] if args.recipe or not args.config else []
    return load_config(TrainConfig, args.overrides, files + ([args.config] if args.config else []))


def cmd_train(args) -> None:
    from tqdm import tqdm

    from flowloop.config import to_yaml
    from flowloop.trainer.recipe import run

    cfg = train_config(args)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return
    summary = run(cfg, log=tqdm.write)  # keeps the live progress line intact
    before, after = summary["before"], summary["after"]
    accuracy = summary["val_metric"] in ("val/accuracy", "val/strict_accuracy")
    if accuracy:
        name = summary["val_metric"].removeprefix("val/").replace("_", " ")
        print(f"\nheld-out {name} {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points) after {summary['steps']} steps")
    else:
        print(f"\nvalidation reward {before:.4f} -> {after:.4f} ({after - before:+.4f}) after {summary['steps']} steps")
    print(f"grids: {summary['grid_before']} (before), {summary['grid_after']} (after)")
    print(f"metrics: {summary['run_dir']}/metrics.jsonl; curve: flowloop plot {summary['run_dir']}")
    if accuracy:
        print(f"precise before/after: flowloop eval, then flowloop eval --checkpoint {summary['run_dir']}/checkpoints/step_{summary['steps']:06d}")


def cmd_bench(args) -> None:
    from flowloop.trainer.bench import bench_command

    bench_command(train_config(args), args.random, args.steps, args.json)


def cmd_export(args) -> None:
    from flowloop.trainer.export import export

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; pass a new folder for the exported files")
    written = export(args.source, args.out, model_path=args.model, ema=args.ema)
    for kind, path in written.items():
        print(f"{kind}: {path}")


def cmd_plot(args) -> None:
    from flowloop.plot import plot_run

    if args.out and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; pass a PNG path, e.g. {Path(args.out) / 'curve.png'}")
    print(f"wrote {plot_run(args.run_dir, args.out)}")


def _load_model(args):
    import torch

    from flowloop.models import load_flow_model, load_trained_weights

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.ema and not args.checkpoint:
        raise ValueError("--ema reads a checkpoint's EMA weights: pass --checkpoint too")
    try:
        model = load_flow_model(args.model, device=args.device)
    except Exception as err:
        raise unreadable_weights(err, f"--model {args.model or '(the embedded model)'}") from err
    try:
        return load_trained_weights(model, args.checkpoint, args.ema) if args.checkpoint else model
    except Exception as err:
        raise unreadable_weights(err, f"--checkpoint {args.checkpoint}") from err


def unreadable_weights(err: Exception, where: str) -> Exception:
    """A safetensors read error (a truncated or corrupt file) as a ValueError naming ``where``;
    any other error as it is."""
    unreadable = type(err).__name__ == "SafetensorError" or (isinstance(err, OSError) and "Unable to load weights" in str(err))
    if not unreadable:
        return err
    cause = err.__cause__ or err.__context__
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
    return ValueError(f"{where}: a weights file cannot be read ({detail}): it looks truncated or corrupt; copy it again")


def cmd_generate(args) -> None:
    from flowloop.trainer.evaluate import sample

    if not args.prompt.strip():
        raise ValueError('the prompt is empty: pass the text to draw, e.g. flowloop generate "a red circle" --out samples')
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for the samples (it is made if missing)")
    model = _load_model(args)
    seeds = [args.seed + k for k in range(args.num)]
    bar, update = _progress(args.num, "generate")
    try:  # a prompt or size the model cannot take fails before any sampling
        samples = sample(model, [args.prompt] * args.num, seeds, args.steps, args.guidance_scale,
                         args.resolution, args.resolution, args.num_frames, progress=update)
    finally:
        bar.close()
    out.mkdir(parents=True, exist_ok=True)
    stem = "_".join(args.prompt.lower().split())[:60]
    for seed, x in zip(seeds, samples):
        print(_save_sample(x, out / f"{stem}_seed{seed}", args.upscale))


def _save_sample(x, stem: Path, upscale: int | None) -> Path:
    """An image ``[C, H, W]`` as ``stem.png``, a video ``[T, C, H, W]`` as ``stem.gif`` (every
    frame), nearest-neighbour upscaled (default: 4x below 128 pixels, else 1x)."""
    from PIL import Image

    from flowloop.trainer.evaluate import to_uint8_images

    frames = to_uint8_images(x if x.ndim == 4 else x[None])  # [T, H, W, 3]
    height, width = frames.shape[1:3]
    factor = upscale or (4 if max(height, width) < 128 else 1)
    pictures = [Image.fromarray(f).resize((width * factor, height * factor), Image.NEAREST) for f in frames]
    if x.ndim == 3:
        path = stem.with_suffix(".png")
        pictures[0].save(path)
    else:
        path = stem.with_suffix(".gif")
        pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=125, loop=0)
    return path


def cmd_eval(args) -> None:
    if args.prompts or args.reward:
        return _eval_prompt_file(args)
    from flowloop.tasks.shapes.task import eval_plan
    from flowloop.trainer.evaluate import evaluate
    from flowloop.visual import print_eval_table, save_grid

    _check_output_files(args)
    model = _load_model(args)
    total = len(eval_plan(args.split, args.samples_per_prompt)[0])
    bar, update = _progress(total, f"eval {args.split}")
    try:
        result, images, prompts = evaluate(model, args.split, args.samples_per_prompt, args.steps, args.guidance_scale,
                                           args.seed, progress=update, resolution=args.resolution)
    finally:
        bar.close()
    print_eval_table(result, title=f"{args.split} split, {args.steps} ODE steps, guidance {args.guidance_scale}")
    _write_json(args.json, result.as_dict())
    if args.grid:
        save_grid(images, prompts, args.grid, per_prompt=args.samples_per_prompt)
        print(f"wrote {args.grid}")


def _eval_prompt_file(args) -> None:
    """`flowloop eval --prompts FILE --reward NAME`: the prompt-file task's validation metrics
    (``val/reward`` and the reward's numeric extras) over every prompt at fixed seeds."""
    from flowloop.reward.registry import build_reward
    from flowloop.reward.serve import parse_kwargs
    from flowloop.reward.worker import RewardFailedError
    from flowloop.tasks import PromptFileTask, load_prompt_file
    from flowloop.tasks.prompt_file import prompt_caption
    from flowloop.trainer.evaluate import first_frames, sample, score_rows, to_uint8_images
    from flowloop.visual import save_grid

    if not (args.prompts and args.reward):
        raise ValueError("--prompts FILE and --reward NAME go together: the samples of a prompt file are scored by a "
                         "reward (a registered name such as jpeg_compressibility, or module:function)")
    _check_output_files(args)
    prompts = load_prompt_file(args.prompts, "--prompts")
    reward_fn = build_reward(args.reward, parse_kwargs(args.reward_kwargs))  # a bad name fails before the model loads
    task = PromptFileTask(prompts, prompts)
    rows = [row for row in prompts for _ in range(args.samples_per_prompt)]
    seeds = [args.seed + k for _ in prompts for k in range(args.samples_per_prompt)]
    model = _load_model(args)
    bar, update = _progress(len(rows), f"eval {Path(args.prompts).name}")
    try:
        samples = sample(model, [prompt_caption(row["raw_prompt"]) for row in rows], seeds, args.steps, args.guidance_scale,
                         args.resolution, args.resolution, args.num_frames, progress=update)
    finally:
        bar.close()
    try:
        scored = score_rows(reward_fn, samples, rows)
    except Exception as err:
        raise RewardFailedError(f"--reward {args.reward} failed: {type(err).__name__}: {err}; a reward returns (scores: one "
                                "float per sample, extra_info: one dict per sample)") from err
    metrics, grid = task.evaluate(to_uint8_images(first_frames(samples)), scored)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    _write_json(args.json, {**metrics, "reward": args.reward, "n": len(rows)})
    if args.grid:
        save_grid(grid.images, grid.captions, args.grid, per_prompt=grid.per_row)
        print(f"wrote {args.grid}")


def _check_output_files(args) -> None:
    """``--json`` and ``--grid`` name files: checked before the evaluation runs, not after."""
    for flag, path in (("--json", args.json), ("--grid", args.grid)):
        if path and Path(path).is_dir():
            raise ValueError(f"{flag} {path} is a folder; pass a file path, e.g. {Path(path) / ('eval.json' if flag == '--json' else 'grid.png')}")


def _write_json(path: str | None, values: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(values, indent=2) + "\n")
        print(f"wrote {path}")


def cmd_serve_reward(args) -> None:
    from flowloop.reward.serve import RewardServer, parse_kwargs

    server = RewardServer(args.name, parse_kwargs(args.kwargs), args.host, args.port, args.max_batch_size, args.max_wait_ms)
    print(f"serving reward {args.name!r} at {server.url} (POST /score, GET /health); Ctrl-C stops", flush=True)
    print(f"train with: rollout.reward.name=remote rollout.reward.kwargs.url={server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pretrain", help="train the embedded shapes model from scratch (key=value overrides)")
    p.add_argument("overrides", nargs="*", help="e.g. steps=20000 batch_size=256 out=runs/pretrain")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("train", help="RL fine-tuning from a recipe: DiffusionNFT on the embedded shapes model by default, "
                                     "FlowGRPO with --recipe shapes_flow_grpo (key=value overrides, e.g. rollout.n=8)")
    p.add_argument("overrides", nargs="*", help="e.g. rollout.n=8 actor.lr=2e-5 trainer.total_steps=100")
    p.add_argument("--recipe", default=None, metavar="NAME",
                   help=f"shipped recipe to start from: {', '.join(recipe_names())} (default: {DEFAULT_RECIPE_NAME}, "
                        "unless only --config is given)")
    p.add_argument("--config", default=None, metavar="PATH", help="your own YAML, merged after --recipe and before the overrides")
    p.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit without training")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="time RL steps, rollout, update and the bare-forward ceiling (TFLOP/s, MFU, memory)")
    p.add_argument("overrides", nargs="*", help="e.g. model.device=cuda rollout.n=8 data.prompts_per_step=2")
    p.add_argument("--recipe", default=None, metavar="NAME", help="shipped recipe (default: shapes)")
    p.add_argument("--config", default=None, metavar="PATH", help="your own YAML, merged after --recipe")
    p.add_argument("--random", default=None, metavar="FAMILY", help="sd3|flux|qwen_image|wan at real size, random weights")
    p.add_argument("--steps", type=int, default=3, help="timed RL steps after one warm-up step")
    p.add_argument("--json", default=None, help="write every figure here")
    p.set_defaults(func=cmd_bench)

    ema_help = ("the checkpoint's EMA weights instead of its trained ones (runs with actor.ema_decay, "
                "whose validation samples with them)")
    p = sub.add_parser("export", help="write a checkpoint as a peft adapter + diffusers LoRA file, or a full diffusers folder")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder (its newest valid checkpoint) or a checkpoint folder")
    p.add_argument("--out", required=True, help="new folder for the exported files")
    p.add_argument("--model", default=None, help="the base model folder, when it has moved since training (full fine-tune)")
    p.add_argument("--ema", action="store_true", help=ema_help)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="PNG learning curve (reward, held-out accuracy) from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curve.png)")
    p.set_defaults(func=cmd_plot)

    device_help = "where the model samples: cpu, cuda or cuda:N (seeds fix the noise on any device; pixels agree across devices to rounding)"
    model_help = "model folder in diffusers layout (default: the embedded shapes model)"
    checkpoint_help = "a flowloop train checkpoint (runs/<name>/checkpoints/step_N) whose weights replace the model's"
    resolution_help = "square image size (default: the model's own)"
    frames_help = "video frames, for a video model such as Wan (e.g. 33); leave unset for images"
    p = sub.add_parser("generate", help="sample images (PNG) or videos (GIF) for one prompt, any model family")
    p.add_argument("prompt")
    p.add_argument("--out", required=True, help="folder for the files")
    p.add_argument("--num", type=_positive, default=4, help="samples to make (seeds seed..seed+num-1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--steps", type=_positive, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=_finite, default=1.0)
    p.add_argument("--resolution", type=_positive, default=None, help=resolution_help)
    p.add_argument("--num-frames", type=_positive, default=None, help=frames_help)
    p.add_argument("--upscale", type=_positive, default=None, help="nearest-neighbour upscale of the saved files (default: 4 below 128 pixels, else 1)")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--checkpoint", default=None, help=checkpoint_help)
    p.add_argument("--device", default="cpu", help=device_help)
    p.add_argument("--ema", action="store_true", help=ema_help)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="strict and GenEval-style accuracy on the shapes world, with 95% bootstrap intervals, "
                                    "or a reward over a prompt file "
                                    "(--prompts FILE --reward NAME), at fixed seeds")
    p.add_argument("--split", choices=["train", "heldout"], default="heldout", help="shapes split (without --prompts)")
    p.add_argument("--prompts", default=None, help="a .txt (one prompt per line), .jsonl or verl .parquet prompt file to evaluate instead of the shapes world")
    p.add_argument("--reward", default=None, help="with --prompts: the reward that scores the samples (e.g. jpeg_compressibility, pickscore, module:function)")
    p.add_argument("--reward-kwargs", action="append", default=[], metavar="JSON|KEY=VALUE",
                   help="the reward's kwargs, repeatable: '{\"device\": \"cuda:0\"}' or scale_kb=100")
    p.add_argument("--json", default=None, help="write the metrics here (shapes: {accuracy, strict_accuracy, score, "
                                                "per_category, n, geneval, strict, bootstrap}; "
                                                "prompts: {val/reward, ..., reward, n})")
    p.add_argument("--grid", default=None, help="also save a PNG grid of the samples here")
    p.add_argument("--samples-per-prompt", type=_positive, default=8, help="seeds seed..seed+k-1 per prompt; 8 keeps small categories from being noisy")
    p.add_argument("--steps", type=_positive, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=_finite, default=1.0)
    p.add_argument("--resolution", type=_positive, default=None, help=resolution_help)
    p.add_argument("--num-frames", type=_positive, default=None, help=frames_help)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--checkpoint", default=None, help=checkpoint_help)
    p.add_argument("--device", default="cpu", help=device_help)
    p.add_argument("--ema", action="store_true", help=ema_help)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve-reward", help="host a registered reward over HTTP for rollout.reward.name=remote")
    p.add_argument("name", help="a registered reward (e.g. shapes, jpeg_compressibility, combined) or module:function")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free one; the URL is printed)")
    p.add_argument("--kwargs", action="append", default=[], metavar="JSON|KEY=VALUE",
                   help="the reward's kwargs, repeatable: '{\"device\": \"cuda:0\"}' or scale_kb=100 or components.shapes=1.0")
    p.add_argument("--max-batch-size", type=int, default=64, help="most samples one reward call scores (across requests)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits to fill with other requests' samples")
    p.set_defaults(func=cmd_serve_reward)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """What bad input, files or services raise: one line and exit code 2, not a traceback."""
    import yaml

    from flowloop.reward.worker import RewardFailedError
    from flowloop.trainer.losses import NonFiniteLossError

    return ValueError, OSError, ImportError, yaml.YAMLError, RewardFailedError, NonFiniteLossError


def one_line(err: BaseException, limit: int = 600) -> str:
    """The error as one line: quoted values over 500 characters (a whole prompt, say) are cut."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = re.sub(r"'[^']{500,}'|\"[^\"]{500,}\"", lambda m: f"{m.group(0)[:80]}...{m.group(0)[0]} ({len(m.group(0)) - 2} chars)", text)
    if not isinstance(err, (ValueError, ImportError)):
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars; --debug shows all)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # for every command's torch work, the trainer's updates included
    try:
        args.func(args)
    except KeyboardInterrupt:
        print(f"flowloop {args.command}: interrupted", file=sys.stderr)
        return 130
    except user_errors() as err:
        if args.debug:
            raise
        print(f"flowloop {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

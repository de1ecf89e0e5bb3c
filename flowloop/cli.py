"""`flowloop` command line: train, eval, generate, export, plot, pretrain, serve-reward.

Each command prints what it does, shows a progress bar on long work, and turns bad input
into a one-line error (exit code 2) that names the field and the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flowloop.allocator import keep_freed_memory
from flowloop.config import DEFAULT_RECIPE as DEFAULT_RECIPE_NAME
from flowloop.config import recipe_names, recipe_path

DEFAULT_SEED = 0
DEFAULT_RECIPE = recipe_path(DEFAULT_RECIPE_NAME)


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
    if summary["val_metric"] == "val/accuracy":
        print(f"\nheld-out accuracy {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points) after {summary['steps']} steps")
    else:
        print(f"\nvalidation reward {before:.4f} -> {after:.4f} ({after - before:+.4f}) after {summary['steps']} steps")
    print(f"grids: {summary['grid_before']} (before), {summary['grid_after']} (after)")
    print(f"metrics: {summary['run_dir']}/metrics.jsonl; curve: flowloop plot {summary['run_dir']}")
    if summary["val_metric"] == "val/accuracy":
        print(f"precise before/after: flowloop eval, then flowloop eval --checkpoint {summary['run_dir']}/checkpoints/step_{summary['steps']:06d}")


def cmd_export(args) -> None:
    from flowloop.trainer.export import export

    written = export(args.source, args.out, model_path=args.model)
    for kind, path in written.items():
        print(f"{kind}: {path}")


def cmd_plot(args) -> None:
    from flowloop.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")


def _load_model(args):
    from flowloop.models import load_flow_model, load_trained_weights

    model = load_flow_model(args.model)
    return load_trained_weights(model, args.checkpoint) if args.checkpoint else model


def cmd_generate(args) -> None:
    from PIL import Image

    from flowloop.trainer.evaluate import ode_sample

    model = _load_model(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [args.seed + k for k in range(args.num)]
    model.tokenize([args.prompt])  # fail fast on unknown words, before any sampling
    resolution = args.resolution or model.default_resolution
    model.latent_shape(resolution, resolution)  # and on a resolution the model cannot take
    bar, update = _progress(args.num, "generate")
    images = ode_sample(model, [args.prompt] * args.num, seeds, args.steps, args.guidance_scale, resolution, progress=update)
    bar.close()
    stem = "_".join(args.prompt.lower().split())[:60]
    for seed, image in zip(seeds, images):
        path = out / f"{stem}_seed{seed}.png"
        Image.fromarray(image).resize((image.shape[1] * args.upscale,) * 2, Image.NEAREST).save(path)
        print(path)


def cmd_eval(args) -> None:
    from flowloop.trainer.evaluate import eval_plan, evaluate
    from flowloop.visual import print_eval_table, save_grid

    model = _load_model(args)
    total = len(eval_plan(args.split, args.samples_per_prompt)[0])
    bar, update = _progress(total, f"eval {args.split}")
    result, images, prompts = evaluate(
        model, args.split, args.samples_per_prompt, args.steps, args.guidance_scale, args.seed, progress=update
    )
    bar.close()
    print_eval_table(result, title=f"{args.split} split, {args.steps} ODE steps, guidance {args.guidance_scale}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.grid:
        save_grid(images, prompts, args.grid, per_prompt=args.samples_per_prompt)
        print(f"wrote {args.grid}")


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

    p = sub.add_parser("export", help="write a checkpoint as a peft adapter + diffusers LoRA file, or a full diffusers folder")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder (its newest valid checkpoint) or a checkpoint folder")
    p.add_argument("--out", required=True, help="new folder for the exported files")
    p.add_argument("--model", default=None, help="the base model folder, when it has moved since training (full fine-tune)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="PNG learning curve (reward, held-out accuracy) from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curve.png)")
    p.set_defaults(func=cmd_plot)

    model_help = "model folder in diffusers layout (default: the embedded shapes model)"
    checkpoint_help = "a flowloop train checkpoint (runs/<name>/checkpoints/step_N) whose weights replace the model's"
    p = sub.add_parser("generate", help="sample images for one prompt into PNG files")
    p.add_argument("prompt")
    p.add_argument("--out", required=True, help="folder for the PNG files")
    p.add_argument("--num", type=int, default=4, help="images to make (seeds seed..seed+num-1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--steps", type=int, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--resolution", type=int, default=None, help="square image size (default: the model's own)")
    p.add_argument("--upscale", type=int, default=4, help="nearest-neighbour upscale of the saved PNGs")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--checkpoint", default=None, help=checkpoint_help)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="GenEval-style accuracy on the shapes world at fixed seeds")
    p.add_argument("--split", choices=["train", "heldout"], default="heldout")
    p.add_argument("--json", default=None, help="write {accuracy, score, per_category, n} here")
    p.add_argument("--grid", default=None, help="also save a PNG grid of the samples here")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="seeds seed..seed+k-1 per prompt; 8 keeps small categories from being noisy")
    p.add_argument("--steps", type=int, default=40, help="ODE steps")
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--checkpoint", default=None, help=checkpoint_help)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # for every command's torch work, the trainer's updates included
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"flowloop {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flowloop {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flowloop export`: turn a training checkpoint into files diffusers and peft load without flowloop.

A checkpoint (`flowloop.trainer.checkpoint`) holds the trained denoiser weights under the names
the training module gives them (``model.safetensors``, or the shards of a trainer that ran on
several ranks in ``dcp/``, joined here in one process: `flowloop.models.trained.read_trained_weights`),
plus ``flowloop.json`` (`flowloop.models.TrainedWeights`) saying what they belong to. Export
checks the checkpoint's sha256 manifest, then writes into ``out``:

LoRA
    adapter_config.json + adapter_model.safetensors   a peft adapter (``PeftModel.from_pretrained``,
                                                      ``set_peft_model_state_dict``), keys
                                                      ``base_model.model.<module>.lora_A.weight``
    pytorch_lora_weights.safetensors                  diffusers' format (``pipe.load_lora_weights``),
                                                      keys ``transformer.<module>.lora_A.weight``
full fine-tune
    the base model folder, its ``transformer/`` weights replaced: ``from_pretrained`` loads it.

Either way ``flowloop.json`` is copied along, so the export says where it came from.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowloop.models import EMBEDDED_MODEL
from flowloop.models.trained import DESCRIPTION, TrainedWeights, read_trained_weights
from flowloop.trainer.checkpoint import CHECKPOINTS, MANIFEST, checkpoint_problem, latest_valid_checkpoint

__all__ = ["DIFFUSERS_LORA_FILE", "export", "resolve_checkpoint"]

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file name ``load_lora_weights`` looks for in a folder."""

_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # peft's in-module key: X.lora_A.<adapter>.weight


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint folder, or a run folder's newest valid checkpoint; its manifest must verify.

    A checkpoint whose files do not match their sha256 is a ValueError naming the file.
    """
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist: pass a run folder (runs/<name>) or a checkpoint folder")
    if (source / MANIFEST).is_file():
        checkpoint = source
    elif (source / CHECKPOINTS).is_dir():
        checkpoint = latest_valid_checkpoint(source)
        if checkpoint is None:
            raise ValueError(f"{source / CHECKPOINTS} holds no valid checkpoint (every one fails its manifest)")
    else:
        raise ValueError(f"{source} is neither a checkpoint folder (with {MANIFEST}) nor a run folder (with {CHECKPOINTS}/)")
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ValueError(f"{checkpoint} is not a valid checkpoint: {problem}")
    return checkpoint


def export(source: str | Path, out: str | Path, model_path: str | Path | None = None, ema: bool = False) -> dict[str, Path]:
    """Export ``source`` (run or checkpoint folder) into the new folder ``out``; returns what was
    written, by kind (``peft``, ``diffusers_lora``, ``diffusers_model``).

    ``model_path`` replaces the base model folder the checkpoint records (a copy of it elsewhere);
    only a full fine-tune reads it. ``ema``: export the checkpoint's EMA weights.
    """
    checkpoint = resolve_checkpoint(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty; export into a new folder")
    description = TrainedWeights.read(checkpoint)
    weights = read_trained_weights(checkpoint, ema)
    if description.finetune == "lora":
        written = _export_lora(weights, description, out)
    else:
        base = Path(model_path) if model_path else Path(description.model_path or EMBEDDED_MODEL)
        written = _export_full(weights, description, base, out)
    (out / DESCRIPTION).write_text(json.dumps({**description.as_dict(), "checkpoint": str(checkpoint.resolve()), "ema": ema}, indent=1))
    return written


def _export_lora(weights: dict[str, torch.Tensor], description: TrainedWeights, out: Path) -> dict[str, Path]:
    from peft import LoraConfig

    # 1. Drop the adapter name peft puts inside module keys; nothing but adapters may be here.
    adapters = {}
    for key, value in weights.items():
        plain = _ADAPTER_NAME.sub(r".\1.weight", key)
        if plain == key:
            raise ValueError(f"LoRA checkpoint holds {key!r}, which is not a LoRA adapter weight")
        adapters[plain] = value.contiguous()
    modules = sorted({key.rsplit(".lora_", 1)[0] for key in adapters})
    rank, alpha = description.lora["rank"], description.lora["alpha"]
    out.mkdir(parents=True, exist_ok=True)

    # 2. peft's adapter folder: the config and the weights under peft's saved names.
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=True,
                        base_model_name_or_path=description.model_path)
    config.save_pretrained(str(out))
    save_file({f"base_model.model.{key}": value for key, value in adapters.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})

    # 3. diffusers' file: ``transformer.`` keys. Its loader takes alpha = rank (scale 1) when no
    # alphas are given, so lora_B carries the alpha / rank scale instead: the same update B A.
    scale = alpha / rank
    diffusers = {f"transformer.{key}": value * scale if ".lora_B." in key else value for key, value in adapters.items()}
    save_file(diffusers, str(out / DIFFUSERS_LORA_FILE), metadata={"format": "pt"})
    return {"peft": out, "diffusers_lora": out / DIFFUSERS_LORA_FILE}


def _export_full(weights: dict[str, torch.Tensor], description: TrainedWeights, base: Path, out: Path) -> dict[str, Path]:
    subfolder = description.trainable_subfolder
    if not (base / "model_index.json").is_file():
        raise FileNotFoundError(f"the checkpoint's base model folder {base} is not here (no model_index.json); "
                                "pass --model with a copy of it")
    component = base / subfolder
    weight_files = sorted(component.glob("*.safetensors"))
    expected = set()
    for file in weight_files:
        with safe_open(str(file), "pt") as handle:
            expected.update(handle.keys())
    if expected != set(weights):
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(f"the checkpoint's weights do not fit {component}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    # The whole base folder, then the trained denoiser as one file in place of its weights.
    if out.exists():
        out.rmdir()  # empty (checked by `export`)
    shutil.copytree(base, out, ignore=lambda folder, names: [
        n for n in names if Path(folder) == component and (n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))
    ])
    name = weight_files[0].name if len(weight_files) == 1 else "diffusion_pytorch_model.safetensors"
    save_file({key: value.contiguous() for key, value in weights.items()}, str(out / subfolder / name), metadata={"format": "pt"})
    return {"diffusers_model": out}

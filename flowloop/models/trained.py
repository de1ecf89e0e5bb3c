"""What a trained checkpoint is, written beside its weights, and loading it back onto a model.

Every ``flowloop train`` checkpoint folder holds ``flowloop.json`` (`TrainedWeights`): the base
model folder, its family, the dtype it trained in, the fine-tune mode and the LoRA settings. With
it the folder alone says how to rebuild the trained model: no run config, no trainer code. A
checkpoint from before this file existed falls back to its run's ``config.yaml`` two folders up.

The trained weights are ``model.safetensors``, or, in a checkpoint of a trainer sharded over
several ranks, the ``model`` part of the torch.distributed.checkpoint folder ``dcp/``
(`read_trained_weights` reads either, in one process).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flowloop.models.lora import add_lora

__all__ = ["CHECKPOINT_FORMAT", "DESCRIPTION", "MANIFEST", "SHARDS", "TrainedWeights", "checkpoint_problem", "file_sha256",
           "load_trained_weights", "read_ema_weights", "read_trained_weights"]

DESCRIPTION = "flowloop.json"
"""The file in a checkpoint folder that describes its weights."""

MANIFEST = "manifest.json"
"""The file a checkpoint folder is written with last: every file's size and sha256."""

SHARDS = "dcp"
"""The subfolder of a sharded checkpoint: the ranks' torch.distributed.checkpoint files (weights
under ``model.``, optimizer state under ``optimizer.``) and its ``.metadata``."""

CHECKPOINT_FORMAT = "flowloop.checkpoint/1"
_WEIGHTS = ("model.safetensors", f"{SHARDS}/.metadata")

FORMAT = "flowloop.trained_weights/1"


@dataclass
class TrainedWeights:
    """How to rebuild the model a checkpoint's ``model.safetensors`` belongs to."""

    model_path: str | None
    """The base model folder (absolute); None is the embedded shapes model."""
    family: str
    """The adapter that loads it (`flowloop.models.family`): tiny, sd3, flux, qwen_image, wan."""
    dtype: str
    """The dtype the base model was loaded in for training (``float32``, ``bfloat16``...)."""
    finetune: str
    """``full``: the weights are the whole denoiser's; ``lora``: only its adapters."""
    lora: dict = field(default_factory=dict)
    """For ``lora``: ``rank``, ``alpha`` and ``target_modules`` (layer-name suffixes, as configured)."""
    trainable_subfolder: str = "transformer"
    """The model folder's component the weights replace (the denoiser)."""

    def __post_init__(self) -> None:
        if self.finetune not in ("full", "lora"):
            raise ValueError(f"finetune must be 'full' or 'lora', got {self.finetune!r}")
        if self.finetune == "lora" and not {"rank", "alpha", "target_modules"} <= set(self.lora):
            raise ValueError(f"a LoRA checkpoint needs lora.rank, lora.alpha and lora.target_modules, got {self.lora}")

    def as_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def read(cls, checkpoint: str | Path) -> "TrainedWeights":
        """Read ``checkpoint/flowloop.json`` (or, for an older checkpoint, its run's config.yaml)."""
        checkpoint = Path(checkpoint)
        path = checkpoint / DESCRIPTION
        if not path.is_file():
            return cls._from_run_config(checkpoint)
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} description")
        return cls(**data)

    @classmethod
    def _from_run_config(cls, checkpoint: Path) -> "TrainedWeights":
        import yaml

        from flowloop.models import family

        run_config = checkpoint.parent.parent / "config.yaml"
        if not run_config.is_file():
            raise FileNotFoundError(f"{checkpoint / DESCRIPTION} is missing (and there is no run config at {run_config}): "
                                    "not a flowloop checkpoint folder")
        config = yaml.safe_load(run_config.read_text())
        model, actor = config["model"], config["actor"]
        lora = {"rank": actor["lora_rank"], "alpha": actor["lora_alpha"], "target_modules": list(actor["lora_target_modules"])}
        return cls(model_path=model.get("path"), family=family(model.get("path")), dtype=str(model.get("dtype", "float32")),
                   finetune=actor["finetune"], lora=lora if actor["finetune"] == "lora" else {})


def checkpoint_problem(path: str | Path, verify_hashes: bool = True) -> str | None:
    """None when ``path`` is a complete checkpoint, else what is wrong with it (for messages)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest.json (incomplete write?)"
    except (OSError, ValueError) as error:
        return f"unreadable manifest.json ({error})"
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != CHECKPOINT_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        return f"manifest.json is not a {CHECKPOINT_FORMAT} manifest"
    if "state.pt" not in manifest["files"]:
        return "the manifest does not list state.pt"
    if not any(name in manifest["files"] for name in _WEIGHTS):
        return f"the manifest lists no weights ({' or '.join(_WEIGHTS)})"
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != info.get("bytes"):
            return f"{name} has {file.stat().st_size} bytes, the manifest says {info.get('bytes')}"
        if verify_hashes and file_sha256(file) != info.get("sha256"):
            return f"{name} does not match its sha256 in the manifest"
    return None


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_trained_weights(model, checkpoint: str | Path, ema: bool = False):
    """Put a checkpoint's denoiser weights (full or LoRA) into ``model`` and return it.

    ``checkpoint`` is a ``runs/<name>/checkpoints/step_N`` folder (weights in one file, or in the
    shards of several ranks: `read_trained_weights`). For LoRA the adapters are first added with
    the settings the checkpoint records, then filled in. ``ema``: its EMA weights instead.
    """
    weights_file = Path(checkpoint) / "model.safetensors"
    if not weights_file.is_file() and not (Path(checkpoint) / SHARDS).is_dir():
        raise FileNotFoundError(f"{weights_file} is missing: pass a checkpoint folder runs/<name>/checkpoints/step_N")
    written_by_train = (Path(checkpoint) / MANIFEST).exists() or (Path(checkpoint) / "state.pt").exists()
    problem = checkpoint_problem(checkpoint) if written_by_train else None
    if problem is not None:
        raise ValueError(f"--checkpoint {checkpoint} is not a valid checkpoint: {problem}; pass an intact one "
                         "(a run folder's checkpoints/step_N; its other checkpoints are checked the same way)")
    description = TrainedWeights.read(checkpoint)
    weights = read_trained_weights(checkpoint, ema)
    module: torch.nn.Module = model.trainable_module()
    if description.finetune == "lora":
        add_lora(module, description.lora["rank"], description.lora["alpha"], description.lora["target_modules"])
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [key for key in missing if description.finetune == "full" or "lora_" in key]
    if unexpected or missing:
        raise ValueError(f"{checkpoint}'s weights do not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def read_trained_weights(checkpoint: str | Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's trained weights (the whole denoiser, or its LoRA adapters), keyed by name,
    on the CPU: its ``model.safetensors``, or the weights of its sharded ``dcp/`` folder read and
    joined in this process (no process group; the optimizer state there is not read).

    ``ema``: the EMA of the trainable weights in their place (a run with ``actor.ema_decay``
    keeps it in ``state.pt``; its validation sampled with it), other weights as they are."""
    weights = _read_live_weights(Path(checkpoint))
    return {**weights, **read_ema_weights(checkpoint)} if ema else weights


def read_ema_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The EMA weights a checkpoint keeps, keyed as in its ``model.safetensors``; a ValueError
    naming the checkpoint when it keeps none."""
    state_file = Path(checkpoint) / "state.pt"
    state = torch.load(state_file, map_location="cpu", weights_only=True) if state_file.is_file() else {}
    ema = (state.get("extra") or {}).get("ema")
    if not ema:
        raise ValueError(f"--ema: {checkpoint} keeps no EMA weights (its run had actor.ema_decay unset); "
                         "leave out --ema to use its trained weights")
    return dict(ema)


def _read_live_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (checkpoint / "model.safetensors").is_file():
        return load_file(str(checkpoint / "model.safetensors"))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / SHARDS))
    entries = reader.read_metadata().state_dict_metadata
    weights = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()
               if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():  # torch warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(weights, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): value for key, value in weights.items()}

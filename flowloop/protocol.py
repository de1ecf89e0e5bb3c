"""`Batch`: the one data protocol every flowloop stage speaks (dataset -> rollout -> reward -> trainer).

A `Batch` of ``bsz`` rows has three parts:
- ``tensors``: a `TensorDict` with ``batch_size [bsz]``, entries of any trailing shape
  (``prompts [bsz, L]``, ``responses [bsz, C, H, W]`` / ``[bsz, T, C, H, W]``, ``all_latents [bsz, W+1, ...]``);
- ``non_tensors``: ``{key: 1-D object array of bsz Python objects}`` (``uid``, ``raw_prompt``, dicts...);
- ``meta_info``: a plain dict about the whole batch (``validate``, ``global_steps``...), except
  ``meta_info["metrics"]`` when it is a list with one entry per row: that travels with the rows.

Every operation but ``batch[key] = value`` returns a new batch and leaves its inputs alone; tensors
may share storage with the input (slices are views); ``meta_info`` is copied shallowly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

# A list under this meta_info key with exactly one entry per row is per-row data: row selection
# (indexing, chunk, split, repeat, padding) selects it like a column and `concat` concatenates it.
ROW_META_KEY = "metrics"
_FILE_FORMAT = "flowloop.Batch/1"


def to_object_array(values: Sequence | np.ndarray, key: str = "value") -> np.ndarray:
    """A 1-D object array with one element per item of ``values`` (lists and dicts stay whole)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or getattr(values, "ndim", 1) == 0:
        raise ValueError(f"non-tensor {key!r} must be a sequence with one item per row, not {type(values).__name__}")
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element-wise: np.array() would turn a list of lists into 2-D
        out[i] = value
    return out


@dataclass(eq=False)
class Batch:
    """Rows of tensors and Python objects plus batch-level ``meta_info``; build it with `from_dict`."""

    tensors: TensorDict
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    __iter__ = None  # rows are selected with batch[idx], keys listed with batch.keys()

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorDict) or self.tensors.batch_dims != 1:
            raise ValueError(f"tensors must be a TensorDict with a 1-D batch_size, got {self.tensors!r}")
        for key, value in self.tensors.items():
            _rows(key, value)
        self.non_tensors = {k: to_object_array(v, k) for k, v in self.non_tensors.items()}
        for key, value in self.non_tensors.items():
            if len(value) != len(self):
                raise ValueError(f"non-tensor {key!r} has {len(value)} rows but the tensors have {len(self)}")
            if key in self.tensors.keys():
                raise ValueError(f"key {key!r} is both a tensor and a non-tensor")
        self.meta_info = dict(self.meta_info)

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Sequence] | None = None,
        meta_info: dict | None = None,
    ) -> Batch:
        """Build a batch, checking that every tensor and non-tensor has the same number of rows."""
        tensors = dict(tensors or {})
        arrays = {k: to_object_array(v, k) for k, v in (non_tensors or {}).items()}
        lengths = [(f"tensor {k!r}", _rows(k, v)) for k, v in tensors.items()]
        lengths += [(f"non-tensor {k!r}", len(v)) for k, v in arrays.items()]
        bsz = lengths[0][1] if lengths else 0
        for name, n in lengths:
            if n != bsz:
                raise ValueError(f"{name} has {n} rows but {lengths[0][0]} has {bsz}")
        return cls(TensorDict(tensors, batch_size=[bsz]), arrays, dict(meta_info or {}))

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys (meta_info keys are not row data)."""
        return [*self.tensors.keys(), *self.non_tensors.keys()]

    def __contains__(self, key: object) -> bool:
        return key in self.non_tensors or (isinstance(key, str) and key in self.tensors.keys())

    def __getitem__(self, item):
        """``batch["key"]``: that tensor or object array; ``batch[rows]``: a new Batch of those rows.

        ``rows`` is a slice, a list/tuple/range of ints, or a 1-D integer or boolean tensor/array.
        """
        if isinstance(item, str):
            if item not in self:
                raise KeyError(f"no key {item!r} in batch; keys: {self.keys()}")
            return self.non_tensors[item] if item in self.non_tensors else self.tensors[item]
        return self._select_rows(self._row_index(item))

    def __setitem__(self, key: str, value: torch.Tensor | Sequence) -> None:
        """Add or replace a column in place: a tensor goes to ``tensors``, anything else to ``non_tensors``."""
        is_tensor = isinstance(value, torch.Tensor)
        column = Batch.from_dict({key: value}) if is_tensor else Batch.from_dict(non_tensors={key: value})
        if len(column) != len(self):
            raise ValueError(f"{key!r} has {len(column)} rows but the batch has {len(self)}")
        if key in (self.non_tensors if is_tensor else self.tensors.keys()):
            raise ValueError(f"{key!r} is already a {'non-tensor' if is_tensor else 'tensor'}; pick another key")
        if is_tensor:
            self.tensors.set(key, value)
        else:
            self.non_tensors[key] = column.non_tensors[key]

    def _row_index(self, item) -> slice | torch.Tensor:
        """A slice, or a 1-D CPU long tensor of row numbers."""
        n = len(self)
        if isinstance(item, slice):
            return item
        if isinstance(item, (list, tuple, range)):
            item = torch.tensor(list(item), dtype=torch.long)
        item = torch.from_numpy(item) if isinstance(item, np.ndarray) else item
        if not isinstance(item, torch.Tensor) or item.dim() != 1 or item.is_floating_point():
            raise TypeError(f"select rows with a slice, a list of ints or a 1-D int/bool index, not {item!r}")
        if item.dtype == torch.bool:
            if item.numel() != n:
                raise IndexError(f"boolean mask has {item.numel()} entries but the batch has {n} rows")
            return item.cpu().nonzero().flatten()
        item = item.to(device="cpu", dtype=torch.long)
        if item.numel() and (item.min() < -n or item.max() >= n):
            raise IndexError(f"row index out of range for a batch of {n} rows: {item.tolist()}")
        return item

    def _select_rows(self, index: slice | torch.Tensor) -> Batch:
        np_index = index if isinstance(index, slice) else index.numpy()
        meta = dict(self.meta_info)
        rows = meta.get(ROW_META_KEY)
        if isinstance(rows, list) and len(rows) == len(self):
            meta[ROW_META_KEY] = rows[index] if isinstance(index, slice) else [rows[i] for i in index.tolist()]
        return Batch(self.tensors[index], {k: v[np_index] for k, v in self.non_tensors.items()}, meta)

    def chunk(self, n: int) -> list[Batch]:
        """``n`` consecutive parts, sizes differing by at most one (larger first). ``n > len`` is a
        ``ValueError``, never an empty part: pad with `pad_batch_to_multiple` so every worker gets rows."""
        if n < 1 or n > len(self):
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {n} non-empty parts")
        base, extra = divmod(len(self), n)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(n)]).tolist()
        return [self[bounds[i] : bounds[i + 1]] for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows; the last one may be shorter (an empty batch gives [])."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[start : start + size] for start in range(0, len(self), size)]

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: interleaved ``[a, a, b, b]`` (GRPO groups) or tiled ``[a, b, a, b]``."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        rows = torch.arange(len(self))
        return self._select_rows(rows.repeat_interleave(n) if interleave else rows.repeat(n))

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Rows of all ``batches`` in order; every batch must have the same tensor and non-tensor keys.

        ``meta_info`` is the first batch's, except ``meta_info["metrics"]``: a list in every batch
        gives their concatenation in order; a list in some batches only is a ``ValueError``.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            missing, extra = set(first.keys()) - set(batch.keys()), set(batch.keys()) - set(first.keys())
            if missing or extra or set(batch.tensors.keys()) != set(first.tensors.keys()):
                raise ValueError(
                    f"concat: batch {i} lacks keys {sorted(missing)} and has extra keys {sorted(extra)} "
                    "compared with batch 0 (or a key is a tensor in one and a non-tensor in the other)"
                )
        tensors = {}
        for key in first.tensors.keys():
            shapes = [tuple(b.tensors[key].shape[1:]) for b in batches]
            if len(set(shapes)) > 1:
                raise ValueError(f"concat: tensor {key!r} has different row shapes across batches: {shapes}")
            tensors[key] = torch.cat([b.tensors[key] for b in batches], dim=0)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        meta = dict(first.meta_info)
        has_rows = [isinstance(b.meta_info.get(ROW_META_KEY), list) for b in batches]
        if any(has_rows) and not all(has_rows):
            raise ValueError(f"concat: meta_info[{ROW_META_KEY!r}] is a list in batches {has_rows} but not all")
        if all(has_rows):
            meta[ROW_META_KEY] = [row for b in batches for row in b.meta_info[ROW_META_KEY]]
        return Batch(TensorDict(tensors, batch_size=[sum(map(len, batches))]), non_tensors, meta)

    def select(
        self,
        tensor_keys: Sequence[str] | None = None,
        non_tensor_keys: Sequence[str] | None = None,
        meta_keys: Sequence[str] | None = None,
    ) -> Batch:
        """A batch with only the listed keys; ``None`` keeps every key of that part, ``[]`` none."""
        for part, wanted, present in (
            ("tensor", tensor_keys, self.tensors.keys()),
            ("non-tensor", non_tensor_keys, self.non_tensors.keys()),
            ("meta_info", meta_keys, self.meta_info.keys()),
        ):
            missing = [k for k in wanted or [] if k not in present]
            if missing:
                raise KeyError(f"select: no {part} keys {missing}; present: {list(present)}")
        tensors = self.tensors if tensor_keys is None else self.tensors.select(*tensor_keys)
        keep = self.non_tensors.keys() if non_tensor_keys is None else non_tensor_keys
        meta = self.meta_info if meta_keys is None else {k: self.meta_info[k] for k in meta_keys}
        return Batch(tensors.copy(), {k: self.non_tensors[k] for k in keep}, meta)

    def union(self, other: Batch) -> Batch:
        """All keys of both batches (same length); a key in both must hold equal values."""
        if len(self) != len(other):
            raise ValueError(f"union: batches have {len(self)} and {len(other)} rows")
        tensors = {**dict(self.tensors.items()), **dict(other.tensors.items())}
        non_tensors = {**self.non_tensors, **other.non_tensors}
        meta = {**self.meta_info, **other.meta_info}
        for key in sorted(set(self.keys()) & set(other.keys())):
            if not _equal(self[key], other[key]):
                raise ValueError(f"union: key {key!r} is in both batches with different values")
        for key in sorted(set(self.meta_info) & set(other.meta_info)):
            if not _equal(self.meta_info[key], other.meta_info[key]):
                raise ValueError(f"union: meta_info[{key!r}] differs between the batches")
        return Batch(TensorDict(tensors, batch_size=[len(self)]), non_tensors, meta)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device`` (non-tensors and meta_info are shared)."""
        return Batch(self.tensors.to(device).copy(), dict(self.non_tensors), self.meta_info)

    def save(self, path: str | os.PathLike) -> None:
        """Write one file atomically (a crash leaves the old file or none, never half of one).

        The file is a `torch.save` pickle of plain dicts, tensors on CPU: load only files you trust.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FILE_FORMAT,
            "batch_size": len(self),
            "tensors": {k: v.detach().to("cpu", copy=True) for k, v in self.tensors.items()},  # no views
            "non_tensors": self.non_tensors,
            "meta_info": self.meta_info,
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: torch.device | str = "cpu") -> Batch:
        """Read a file written by `save`; a missing or unreadable file raises an error naming ``path``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no Batch file at {path}")
        try:
            payload = torch.load(path, map_location=map_location, weights_only=False)
        except Exception as error:
            raise ValueError(f"{path} is not a readable Batch file ({type(error).__name__}: {error})") from error
        if not isinstance(payload, dict) or payload.get("format") != _FILE_FORMAT:
            raise ValueError(f"{path} is not a Batch file (expected format {_FILE_FORMAT!r})")
        tensors = TensorDict(payload["tensors"], batch_size=[payload["batch_size"]])
        return cls(tensors, payload["non_tensors"], payload["meta_info"])

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {list(v.shape)} {str(v.dtype)[6:]}" for k, v in self.tensors.items())
        meta = f"non_tensors={list(self.non_tensors)}, meta_info={list(self.meta_info)}"
        return f"Batch(len={len(self)}, tensors={{{tensors}}}, {meta})"


# ---- padding ------------------------------------------------------------------------------------


def pad_to_length(
    tensors: Sequence[torch.Tensor], length: int, pad_value: float | int, side: str = "left", dim: int = 0
) -> torch.Tensor:
    """Pad each tensor along ``dim`` to ``length`` and stack them: ``[N, ...]`` with ``dim`` sized ``length``.

    E.g. prompt ids ``[L_i]`` left-padded to ``prompt_length``, prompt embeddings ``[L_i, D]``
    right-padded to ``max_sequence_length``. A tensor longer than ``length`` is an error, never cut.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not tensors:
        raise ValueError("pad_to_length needs at least one tensor")
    padded = []
    for row, t in enumerate(tensors):
        if t.shape[dim] > length:
            raise ValueError(f"row {row} has length {t.shape[dim]} along dim {dim}, more than the pad length {length}")
        shape = list(t.shape)
        shape[dim] = length - t.shape[dim]
        fill = t.new_full(shape, pad_value)
        padded.append(torch.cat([fill, t] if side == "left" else [t, fill], dim=dim))
        if padded[row].shape != padded[0].shape:
            raise ValueError(f"row {row} has shape {tuple(t.shape)}; row 0 has {tuple(tensors[0].shape)}")
    return torch.stack(padded)


def pad_batch_to_multiple(batch: Batch, multiple: int) -> tuple[Batch, int]:
    """Append copies of the first rows (cycling) until ``len`` divides by ``multiple``; returns the pad count."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    pad_count = -len(batch) % multiple
    if pad_count == 0:
        return batch, 0
    if len(batch) == 0:
        raise ValueError("cannot pad an empty batch by repeating rows")
    index = torch.cat([torch.arange(len(batch)), torch.arange(pad_count) % len(batch)])
    return batch._select_rows(index), pad_count


def unpad(batch: Batch, pad_count: int) -> Batch:
    """Drop the last ``pad_count`` rows added by `pad_batch_to_multiple`."""
    if not 0 <= pad_count <= len(batch):
        raise ValueError(f"cannot remove {pad_count} padding rows from a batch of {len(batch)}")
    return batch if pad_count == 0 else batch[: len(batch) - pad_count]


# ---- helpers ------------------------------------------------------------------------------------


def _rows(key: str, tensor: torch.Tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor {key!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"tensor {key!r} is 0-d; every tensor needs a leading batch dimension")
    return tensor.shape[0]


def _equal(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays (element by element), lists, tuples, dicts and plain objects."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (np.ndarray, list, tuple)) and isinstance(b, (np.ndarray, list, tuple)):
        same = type(a) is type(b) and len(a) == len(b) and getattr(a, "shape", None) == getattr(b, "shape", None)
        return same and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False

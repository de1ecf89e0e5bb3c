"""Float32 LoRA adapters whose matmuls run in the model's dtype: the denoiser's forward under
``torch.autocast``.

The adapters stay float32 because AdamW steps of lr ~1e-4 fall below bf16's resolution
(`flowloop.models.lora`); but a float32 branch beside every bf16 linear makes every rollout
forward pay float32 (or TF32) matmuls for it. Under autocast each adapter weight is cast to the
model's dtype once per forward call (autocast caches the casts of leaf weights inside its region)
and the branch runs on bf16 tensor cores, while the optimizer goes on stepping the float32
weights; flow_grpo trains its adapters this way. Rollout and update both run under it, so the
replay computes what the rollout computed. Autocast also runs the ops of its float32 list
(layer norm, softmax, ...) in float32.
"""

from __future__ import annotations

import types

import torch
from torch import nn

LOW_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_forward(module: nn.Module, dtype: str) -> None:
    """Make every call of ``module`` run under ``torch.autocast`` in ``dtype`` (``bfloat16`` or
    ``float16``), in place. A copy of the module (``copy.deepcopy``) keeps it, bound to the copy."""
    if dtype not in LOW_PRECISION:
        raise ValueError(f"model.autocast needs model.dtype bfloat16 or float16 (float32 weights would gain "
                         f"nothing), got model.dtype={dtype}; set model.autocast=false")
    module._autocast = (next(module.parameters()).device.type, LOW_PRECISION[dtype])
    module.forward = types.MethodType(_forward_under_autocast, module)


def _forward_under_autocast(self, *args, **kwargs):
    device_type, dtype = self._autocast
    with torch.autocast(device_type, dtype=dtype):
        return type(self).forward(self, *args, **kwargs)

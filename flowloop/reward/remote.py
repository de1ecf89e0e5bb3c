"""``remote``: a reward scored by a server over HTTP (`flowloop serve-reward`), and the wire format.

Why: a reward model may need its own environment, GPU or machine (Flow-GRPO serves GenEval,
DeQA and UnifiedReward the same way). Configure it as

    rollout:
      reward:
        name: remote
        kwargs: {url: "http://10.0.0.2:8000", timeout_s: 60, max_retries: 3, batch_size: 64}

Wire format (one ``POST {url}/score`` per chunk of at most ``batch_size`` samples):

- request body: a safetensors file holding one uint8 tensor ``images`` ``[B, C, H, W]`` (or
  ``[B, T, C, H, W]``), the float images quantised as ``round(255 x)`` (4x smaller than
  float32, and what an image reward model sees anyway), with the prompts and metadata as JSON
  strings in the safetensors header (``__metadata__``: ``prompts``, ``metadata``). Metadata
  values JSON cannot carry are sent as their ``str()``;
- answer: JSON ``{"scores": [B floats or null], "extra_info": [B dicts], "errors": [B str or null]}``
  in the request's order; a row with an error fails the call (so `RewardWorker` re-scores the
  batch row by row and only that row fails), with the server's message.

Retries: a refused connection, a timeout (``timeout_s`` per connect and per read) or HTTP
502/503/504 is retried ``max_retries`` times, waiting ``backoff_s * 2**attempt`` between
attempts; then a ConnectionError names the url and the attempts, and `RewardWorker` fails the
whole batch at once (no row-by-row re-scoring of a dead server). ``rollout.reward.timeout_s``
bounds the whole call, retries included. Any other HTTP error (the
server could not read the request) fails at once with the server's message.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from flowloop.reward.registry import RewardFn, register_reward
from flowloop.reward.worker import in_daemon_thread

logger = logging.getLogger(__name__)

RETRY_STATUS = (502, 503, 504)
"""HTTP answers that mean "not now" (a proxy or an overloaded server): retried like a timeout."""


@register_reward("remote", factory=True)
def remote(url: str, timeout_s: float = 60.0, max_retries: int = 3, batch_size: int = 64, backoff_s: float = 0.5) -> RewardFn:
    """The async batched function scoring through the server at ``url`` (its base address, as
    `flowloop serve-reward` prints it). Chunks of one call are sent concurrently."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward 'remote': url must start with http:// or https://, got {url!r}")
    if timeout_s <= 0 or max_retries < 0 or batch_size < 1 or backoff_s < 0:
        raise ValueError(f"reward 'remote' needs timeout_s > 0, max_retries >= 0, batch_size >= 1 and backoff_s >= 0, "
                         f"got {timeout_s}, {max_retries}, {batch_size}, {backoff_s}")
    endpoint = url.rstrip("/") + "/score"

    async def score(images, prompts, metadata):
        starts = range(0, len(prompts), batch_size)
        answers = await asyncio.gather(*(
            _post_with_retries(endpoint, encode_request(images[s:s + batch_size], prompts[s:s + batch_size],
                                                        metadata[s:s + batch_size]), timeout_s, max_retries, backoff_s)
            for s in starts
        ))
        scores, extra = [], []
        for start, answer in zip(starts, answers):
            chunk_scores, chunk_extra = _read_answer(endpoint, answer, len(prompts[start:start + batch_size]))
            scores += chunk_scores
            extra += chunk_extra
        return scores, extra

    return score


# -- wire format ----------------------------------------------------------------------------
def encode_request(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> bytes:
    """Float images in [0, 1] (uint8 passes as is), prompts and metadata -> a request body."""
    pixels = images.detach().cpu()
    if pixels.is_floating_point():
        pixels = (pixels.float() * 255).round().clamp(0, 255).to(torch.uint8)
    header = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(list(metadata), default=to_json)}
    return save_safetensors({"images": pixels.contiguous()}, metadata=header)


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    """A request body -> float images ``[B, ...]`` in [0, 1], prompts, metadata; ValueError if malformed."""
    try:
        tensors = load_safetensors(body)
        # load() drops the header's __metadata__; read it directly (u64 little-endian length, then JSON).
        header = json.loads(body[8:8 + int.from_bytes(body[:8], "little")]).get("__metadata__") or {}
        prompts, metadata = json.loads(header["prompts"]), json.loads(header["metadata"])
    except Exception as err:
        raise ValueError(f"the request is not a safetensors body with prompts and metadata: {type(err).__name__}: {err}") from None
    images = tensors.get("images")
    if images is None or images.dtype != torch.uint8 or images.ndim not in (4, 5):
        got = "nothing" if images is None else f"{images.dtype} {tuple(images.shape)}"
        raise ValueError(f"'images' must be a uint8 [B, C, H, W] or [B, T, C, H, W] tensor, got {got}")
    if not len(images) == len(prompts) == len(metadata):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; need one each per sample")
    return images.float() / 255, prompts, metadata


def to_json(value: Any) -> Any:
    """``json.dumps`` default: numpy and torch values as numbers or lists, anything else as ``str``."""
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    return str(value)


# -- HTTP -----------------------------------------------------------------------------------
async def _post_with_retries(endpoint: str, body: bytes, timeout_s: float, max_retries: int, backoff_s: float) -> dict:
    attempts = max_retries + 1
    last = None
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            return await in_daemon_thread(_post, endpoint, body, timeout_s)
        except urllib.error.HTTPError as err:
            if err.code not in RETRY_STATUS:
                raise RuntimeError(f"reward server {endpoint} answered HTTP {err.code}: {_error_text(err)}") from None
            last = f"HTTP {err.code}: {_error_text(err)}"
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        logger.warning("reward server %s, attempt %d of %d: %s", endpoint, attempt + 1, attempts, last)
    raise ConnectionError(f"reward server {endpoint} gave no answer after {attempts} attempt(s) "
                          f"(timeout_s={timeout_s} each, max_retries={max_retries}); last error: {last}. "
                          "Is `flowloop serve-reward` running there?")


def _post(endpoint: str, body: bytes, timeout_s: float) -> dict:
    request = urllib.request.Request(endpoint, data=body, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read())["error"]
    except Exception:
        return str(err.reason)


def _read_answer(endpoint: str, answer: dict, count: int) -> tuple[list[float], list[dict]]:
    scores, extra, errors = answer.get("scores"), answer.get("extra_info"), answer.get("errors")
    if not isinstance(scores, list) or not isinstance(extra, list) or len(scores) != count or len(extra) != count:
        raise ValueError(f"reward server {endpoint} answered {str(answer)[:200]!r}; expected {count} scores and extra_info")
    failed = [(i, e) for i, e in enumerate(errors or []) if e is not None]
    if failed:
        i, error = failed[0]
        raise RuntimeError(f"reward server {endpoint}: {len(failed)} of {count} samples failed; sample {i}: {error}")
    return scores, extra

"""Flow-GRPO's text-rendering reward: does the image show the text quoted in its prompt?

The target is the first double-quoted span of the prompt (``a sign that says "open late"`` ->
``open late``). Tesseract reads each image; the score follows Flow-GRPO's ``OcrScorer`` exactly:
both texts are lowercased with all whitespace removed (OCR spacing is unreliable), a target found
inside the recognized text scores 1, otherwise the score is ``1 - levenshtein / len(target)``,
floored at 0 so a page of unrelated text costs no more than reading nothing. Flow-GRPO used
PaddleOCR; Tesseract is an apt package and needs no downloaded weights.

Tesseract runs as a subprocess (one per image, in parallel threads), so no Python binding is
needed. Images are upscaled before reading: Tesseract misses glyphs only a few pixels tall.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image

from flowloop.reward.registry import register_reward

OCR_SIDE = 512
"""Images whose shorter side is below this are upscaled (integer factor, Lanczos) before OCR."""
TESSERACT_ARGS = ("--psm", "3", "-l", "eng")
"""Automatic page segmentation (text may sit anywhere in a generated image), English model."""
INSTALL_HINT = "apt-get install tesseract-ocr (Debian/Ubuntu) or brew install tesseract (macOS)"

_QUOTED = re.compile(r"[\"\u201c]([^\"\u201d]*)[\"\u201d]")  # straight or curly double quotes


@register_reward("ocr")
def ocr_reward(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> tuple[list[float], list[dict]]:
    """Score each ``[C, H, W]`` image by how well Tesseract reads back its prompt's quoted text.

    Extra info: ``ocr_text`` (what Tesseract read, whitespace collapsed) and ``target_text``.
    A video ``[B, T, C, H, W]`` needs `flowloop.reward.video.per_frame` around this function.
    """
    if images.ndim != 4:
        raise ValueError(
            f"the ocr reward scores images [B, C, H, W], got shape {tuple(images.shape)}; "
            "wrap it with flowloop.reward.video.per_frame for videos"
        )
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
    targets = [target_text(prompt) for prompt in prompts]  # fail on a bad prompt before running OCR
    pictures = [_to_pil(image) for image in images]
    with ThreadPoolExecutor(max_workers=min(len(pictures), os.cpu_count() or 1) or 1) as pool:
        texts = list(pool.map(read_text, pictures))
    scores = [text_score(text, target) for text, target in zip(texts, targets)]
    return scores, [{"ocr_text": text, "target_text": target} for text, target in zip(texts, targets)]


def target_text(prompt: str) -> str:
    """The first double-quoted span of ``prompt``; a prompt without one (or with an empty one)
    cannot be scored, so it is a ValueError rather than a silent zero."""
    match = _QUOTED.search(prompt)
    if match is None:
        raise ValueError(f'the ocr reward needs the target text in double quotes, e.g. \'a sign that says "hi"\'; got prompt {prompt!r}')
    if not match.group(1).strip():
        raise ValueError(f"the quoted target text is empty in prompt {prompt!r}")
    return match.group(1)


def text_score(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR score in [0, 1]: 1 if the target appears in the recognized text, else
    ``max(0, 1 - levenshtein(recognized, target) / len(target))``, ignoring case and whitespace."""
    recognized, target = _squash(recognized), _squash(target)
    if not target:
        raise ValueError("the target text has no characters besides whitespace")
    if target in recognized:
        return 1.0
    return max(0.0, 1.0 - levenshtein(recognized, target) / len(target))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each costing 1) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def read_text(picture: Image.Image) -> str:
    """Run Tesseract on one picture; returns what it read with whitespace collapsed to spaces."""
    binary = shutil.which("tesseract")
    if binary is None:
        raise RuntimeError(f"the ocr reward needs the Tesseract OCR program, which is not on PATH. Install it with: {INSTALL_HINT}")
    # 1. Grayscale, upscaled by an integer factor so small glyphs become readable.
    picture = picture.convert("L")
    factor = -(-OCR_SIDE // min(picture.size))  # ceil
    if factor > 1:
        picture = picture.resize((picture.width * factor, picture.height * factor), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    # 2. One Tesseract process, single-threaded: the pool already runs one per core.
    result = subprocess.run(
        [binary, "stdin", "stdout", *TESSERACT_ARGS],
        input=buffer.getvalue(),
        capture_output=True,
        env={**os.environ, "OMP_THREAD_LIMIT": "1"},
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"tesseract failed (exit {result.returncode}): {result.stderr.decode(errors='replace').strip()}")
    return " ".join(result.stdout.decode(errors="replace").split())


def _squash(text: str) -> str:
    return "".join(text.split()).lower()


def _to_pil(image: torch.Tensor) -> Image.Image:
    """``[C, H, W]`` float in [0, 1] (C = 1 or 3) -> an 8-bit PIL image."""
    if image.shape[0] not in (1, 3):
        raise ValueError(f"expected 1 or 3 channels, got image shape {tuple(image.shape)}")
    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()  # [C, H, W]
    if array.shape[0] == 1:
        return Image.fromarray(array[0].numpy())  # 2-D uint8 -> mode "L"
    return Image.fromarray(array.permute(1, 2, 0).numpy())  # [H, W, 3] uint8 -> "RGB"

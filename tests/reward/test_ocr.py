"""The OCR reward: target parsing, Flow-GRPO's score, and Tesseract on text drawn with a real font."""

from __future__ import annotations

import glob
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowloop.reward.ocr import levenshtein, ocr_reward, target_text, text_score

FONT_CANDIDATES = ("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf", "/usr/share/fonts/**/*Sans*Bold*.ttf")

needs_tesseract = pytest.mark.skipif(
    shutil.which("tesseract") is None, reason="tesseract not installed (apt-get install tesseract-ocr)"
)


def _font_path() -> str:
    for pattern in FONT_CANDIDATES:
        found = sorted(glob.glob(pattern, recursive=True))
        if found:
            return found[0]
    pytest.skip("no TrueType font found under /usr/share/fonts (apt-get install fonts-dejavu-core)")


def _text_image(text: str, side: int, font_size: int | None = None) -> torch.Tensor:
    """``text`` in dark ink on a coloured square of ``side`` px, as a [3, H, W] float tensor."""
    canvas = Image.new("RGB", (side, side), (225, 200, 130))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.truetype(_font_path(), size=font_size or max(9, side // len(text) + side // 16))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((side - right - left) / 2, (side - bottom - top) / 2), text, fill=(25, 25, 70), font=font)
    return torch.from_numpy(np.array(canvas)).permute(2, 0, 1).float() / 255


def test_target_is_the_first_quoted_span():
    assert target_text('a neon sign that says "Open Late" above a "bar" door') == "Open Late"
    assert target_text("a mug printed with \u201cgood morning\u201d") == "good morning"


def test_prompt_without_quoted_text_is_an_error_naming_it():
    with pytest.raises(ValueError, match="a cat on a mat"):
        target_text("a cat on a mat")
    with pytest.raises(ValueError, match="empty"):
        target_text('a blank sign ""')


def test_levenshtein_known_distances():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_text_score_follows_flow_grpo():
    assert text_score("Hello  World", "hello world") == 1.0  # case and spacing ignored
    assert text_score("xx hello world yy", "hello world") == 1.0  # target found inside the reading
    assert text_score("helo world", "hello world") == pytest.approx(1 - 1 / 10)  # 10 chars without space
    assert text_score("", "hello") == 0.0
    assert text_score("a completely unrelated long paragraph", "hi") == 0.0  # floored at 0


@needs_tesseract
@pytest.mark.parametrize("side", [64, 128, 256])
def test_drawn_text_scores_high_for_its_prompt_and_low_for_another(side):
    words = ["hello world", "open late"]
    images = torch.stack([_text_image(text, side) for text in words])  # [2, 3, side, side]
    right = [f'a sign that says "{text}"' for text in words]
    wrong = ['a sign that says "quantum zebra"', 'a poster reading "fig jam"']
    scores, extra = ocr_reward(torch.cat([images, images]), right + wrong, [{}] * 4)
    assert all(score >= 0.9 for score in scores[:2]), (scores, extra)
    assert all(score < 0.5 for score in scores[2:]), (scores, extra)
    assert all(set(info) == {"ocr_text", "target_text"} for info in extra)
    assert [info["target_text"] for info in extra] == words + ["quantum zebra", "fig jam"]


@needs_tesseract
def test_tiny_glyphs_are_read_thanks_to_the_upscale():
    # 7 px type in a 64 px image: Tesseract 5 reads nothing at native size, all of it upscaled.
    images = torch.stack([_text_image(text, 64, font_size=7) for text in ("hello world", "open late")])
    scores, extra = ocr_reward(images, ['"hello world"', '"open late"'], [{}] * 2)
    assert scores == [1.0, 1.0], extra


@needs_tesseract
def test_grayscale_image_is_read():
    image = _text_image("grey", 96).mean(dim=0, keepdim=True)  # [1, H, W]
    scores, extra = ocr_reward(image[None], ['"grey"'], [{}])
    assert scores == [1.0], extra


def test_missing_tesseract_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no tesseract to find
    with pytest.raises(RuntimeError, match="apt-get install tesseract-ocr"):
        ocr_reward(torch.ones(1, 3, 32, 32), ['"hi"'], [{}])


def test_video_input_points_to_the_per_frame_wrapper():
    with pytest.raises(ValueError, match="per_frame"):
        ocr_reward(torch.ones(1, 2, 3, 32, 32), ['"hi"'], [{}])

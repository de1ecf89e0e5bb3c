"""CLIP score, PickScore and the aesthetic predictor on a tiny random CLIP saved to a temp folder.

Expected values come from transformers' own path (its image processor on PIL images, then
`CLIPModel.forward`), so the torch preprocessing and embedding code are checked against it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

from flowloop.reward import RewardSample, RewardWorker, build_reward
from flowloop.reward.clip_scorers import (
    AESTHETIC_HEAD_FILE,
    AESTHETIC_PATH_ENV,
    CLIP_PATH_ENV,
    PICKSCORE_PATH_ENV,
    aesthetic_head,
    load_clip,
    make_aesthetic,
    make_clip_score,
    make_pickscore,
)
from tests.reward.test_worker import score_all

WORDS = "a photo of red blue green circle square triangle cat dog on the grass".split()
PROMPTS = ["a photo of a red circle", "a blue square on the grass", "a cat", "a dog on a green triangle"]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no hub): <bos> words <eos>, padded with <pad>."""
    specials = ["<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 2), ("<|endoftext|>", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=16,
    )


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny CLIP (32 px images, 16-d projection) with tokenizer, processor and aesthetic head."""
    folder = tmp_path_factory.mktemp("tiny_clip")
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    tiny = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = CLIPConfig(
        text_config={**tiny, "vocab_size": len(tokenizer), "max_position_embeddings": 16, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3},
        vision_config={**tiny, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    CLIPModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    head = aesthetic_head(16)
    for param in head.parameters():  # larger than the default init, so images score far apart
        torch.nn.init.normal_(param, std=0.1)
    save_file({f"layers.{key}": value.contiguous() for key, value in head.state_dict().items()}, str(folder / AESTHETIC_HEAD_FILE))
    return folder


def _images(height: int, width: int, count: int = 4, seed: int = 0) -> torch.Tensor:
    """Random 8-bit-exact images ``[count, 3, H, W]`` in [0, 1] (8x8 blobs upsampled: structure a bad crop would change)."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 8, 8, generator=generator)
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return (smooth * 255).round() / 255


def _reference(folder, images: torch.Tensor, prompts: list[str]):
    """transformers' own path: its image processor on PIL images, then `CLIPModel.forward`."""
    model = CLIPModel.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    pil = [Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()) for image in images]
    pixels = CLIPImageProcessor.from_pretrained(folder)(images=pil, return_tensors="pt")["pixel_values"]
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
        cosine = out.logits_per_image.diagonal() / model.logit_scale.exp()  # logits = exp(scale) * cos
    return cosine.tolist(), out.logits_per_image.diagonal().tolist(), out.image_embeds


@pytest.mark.parametrize("height, width, atol", [(32, 32, 1e-4), (48, 40, 3e-3), (40, 64, 3e-3)])
def test_clip_score_is_the_reference_cosine(clip_dir, height, width, atol):
    # 32 px needs no resize: exact. The others are resized and center-cropped, where PIL's and
    # torch's bicubic differ by < 1e-3 in cosine; a corner crop or a squash is off by > 2e-2.
    images = _images(height, width)
    scores, extra = make_clip_score(clip_dir)(images, PROMPTS, [{}] * 4)
    cosine, _, _ = _reference(clip_dir, images, PROMPTS)
    assert len(scores) == len(extra) == 4 and all(set(info) == {"cosine"} for info in extra)
    assert [info["cosine"] for info in extra] == pytest.approx(cosine, abs=atol)
    assert scores == pytest.approx([100 * max(info["cosine"], 0.0) for info in extra])


def test_pickscore_is_logit_scale_times_cosine(clip_dir):
    images = _images(32, 32)
    scores, _ = make_pickscore(clip_dir)(images, PROMPTS, [{}] * 4)
    _, logits, _ = _reference(clip_dir, images, PROMPTS)
    assert scores == pytest.approx(logits, abs=1e-3)


def test_aesthetic_is_the_mlp_on_the_normalized_image_embedding(clip_dir):
    images = _images(32, 32)
    scores, extra = make_aesthetic(clip_dir)(images, PROMPTS, [{}] * 4)
    _, _, embeds = _reference(clip_dir, images, PROMPTS)  # image_embeds: projected, unit norm
    w = load_file(str(clip_dir / AESTHETIC_HEAD_FILE))
    x = embeds
    for i in (0, 2, 4, 6, 7):  # Linear layers only; dropout is off at inference
        x = x @ w[f"layers.{i}.weight"].T + w[f"layers.{i}.bias"]
    assert scores == pytest.approx(x.squeeze(-1).tolist(), rel=1e-4)
    assert extra == [{}] * 4


def test_scores_are_deterministic_per_row_and_depend_on_the_prompt(clip_dir):
    score = make_pickscore(clip_dir)
    images = _images(32, 32)
    first, _ = score(images, PROMPTS, [{}] * 4)
    again, _ = score(images, PROMPTS, [{}] * 4)
    alone = [score(images[i : i + 1], PROMPTS[i : i + 1], [{}])[0][0] for i in range(4)]
    assert first == again
    assert first == pytest.approx(alone, abs=1e-5)  # padding to a longer prompt changes nothing
    swapped, _ = score(images[:1].expand(2, -1, -1, -1), ["a red circle", "a dog on the grass"], [{}] * 2)
    assert abs(swapped[0] - swapped[1]) > 1e-3


def test_a_folder_saved_with_clip_processor_works_too(clip_dir, tmp_path):
    # transformers 5 saves a CLIPProcessor as one processor_config.json, older ones as
    # preprocessor_config.json + tokenizer files: both layouts must load the same.
    folder = tmp_path / "processor_layout"
    CLIPModel.from_pretrained(clip_dir).save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor.from_pretrained(clip_dir), tokenizer=_tokenizer()).save_pretrained(folder)
    images = _images(40, 64)
    assert make_clip_score(folder)(images, PROMPTS, [{}] * 4) == make_clip_score(clip_dir)(images, PROMPTS, [{}] * 4)


def test_model_is_loaded_once_per_folder_and_device(clip_dir):
    assert load_clip(clip_dir) is load_clip(str(clip_dir), torch.device("cpu"))
    assert load_clip(clip_dir, dtype="bfloat16") is not load_clip(clip_dir)


def test_registered_rewards_take_the_folder_from_kwargs_or_the_environment(clip_dir, monkeypatch):
    images = _images(32, 32)
    expected = make_clip_score(clip_dir)(images, PROMPTS, [{}] * 4)
    monkeypatch.delenv(CLIP_PATH_ENV, raising=False)
    with pytest.raises(ValueError, match=CLIP_PATH_ENV):
        build_reward("clip_score")
    assert build_reward("clip_score", {"model_path": str(clip_dir), "device": "cpu"})(images, PROMPTS, [{}] * 4) == expected
    monkeypatch.setenv(CLIP_PATH_ENV, str(clip_dir))
    assert build_reward("clip_score")(images, PROMPTS, [{}] * 4) == expected
    for name, env in (("pickscore", PICKSCORE_PATH_ENV), ("aesthetic", AESTHETIC_PATH_ENV)):
        monkeypatch.setenv(env, str(clip_dir))
        assert len(build_reward(name)(images, PROMPTS, [{}] * 4)[0]) == 4


def test_reward_worker_scores_with_the_pickscore_kwargs(clip_dir):
    images = _images(32, 32)
    expected, _ = make_pickscore(clip_dir)(images, PROMPTS, [{}] * 4)

    worker = RewardWorker("pickscore", max_batch_size=4, max_wait_ms=50, kwargs={"model_path": str(clip_dir)})
    results = asyncio.run(score_all(worker, [RewardSample(i, p) for i, p in zip(images, PROMPTS)]))
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-5)
    assert all(r.extra_info["reward_error"] is None and "cosine" in r.extra_info for r in results)


def test_bfloat16_model_scores_close_to_float32(clip_dir):
    images = _images(40, 64)
    full, _ = make_pickscore(clip_dir)(images, PROMPTS, [{}] * 4)
    half, _ = make_pickscore(clip_dir, dtype="bfloat16")(images, PROMPTS, [{}] * 4)
    assert half == pytest.approx(full, abs=0.2)  # pickscore ~ 14 * cosine here; bf16 keeps ~3 digits


def test_missing_folder_or_head_is_an_error_naming_it(clip_dir, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no_such_clip"):
        make_clip_score(tmp_path / "no_such_clip")
    monkeypatch.setenv(CLIP_PATH_ENV, str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match=rf"gone.*\${CLIP_PATH_ENV}"):
        build_reward("clip_score")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((clip_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=AESTHETIC_HEAD_FILE):
        make_aesthetic(bare)


def test_video_input_is_rejected_with_a_pointer_to_per_frame(clip_dir):
    with pytest.raises(ValueError, match="per_frame"):
        make_clip_score(clip_dir)(torch.rand(2, 3, 3, 32, 32), PROMPTS[:2], [{}] * 2)


def test_grayscale_images_match_their_rgb_copies(clip_dir):
    gray = _images(32, 32)[:, :1]  # [4, 1, 32, 32]
    score = make_clip_score(clip_dir)
    assert score(gray, PROMPTS, [{}] * 4) == score(gray.expand(-1, 3, -1, -1), PROMPTS, [{}] * 4)

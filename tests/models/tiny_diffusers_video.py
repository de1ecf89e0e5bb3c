"""Tiny random Qwen-Image and Wan pipeline folders, written the way the real ones are laid out.

Every component is its real class with a tiny config (one or two layers, a few channels), saved
with ``save_pretrained`` next to a ``model_index.json`` like the published one, so the tests load
them through `flowloop.models.load_flow_model`, the path real checkpoints take. Tokenizers are
built here with the ``tokenizers`` library (nothing is downloaded): a byte-level BPE trained on a
small corpus for Qwen2, a Unigram vocabulary for UMT5.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from flowloop.models.qwen_image import SYSTEM_PROMPT

PROMPTS = ["a red circle", "two blue squares on a green mat", "a cat reading a book", "a sign that says open"]
"""Prompts the tests use; both tokenizers cover them (and any lowercase text, letter by letter)."""
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def qwen_tokenizer(corpus: list[str] = PROMPTS):
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer) with Qwen's chat special tokens.

    Merges are learned from the prompt template and ``corpus``, so the template is a few dozen
    tokens, as with the real tokenizer; any other text falls back to single bytes.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.train_from_iterator([SYSTEM_PROMPT, "system\nuser\nassistant\n", *corpus] * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                          extra_special_tokens=QWEN_SPECIALS)


def t5_tokenizer(corpus: list[str] = PROMPTS):
    """A ``T5Tokenizer`` (Unigram, ``<pad>``=0, ``</s>``=1, ``<unk>``=2) whose words are ``corpus``'s,
    with single letters and digits as the fallback pieces. No chat template: the adapter adds one."""
    from transformers import T5Tokenizer

    pieces = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "\u2581": -2.0}
    for word in sorted({w for text in corpus for w in text.split()}):
        pieces.setdefault("\u2581" + word, -5.0)
    for char in string.ascii_lowercase + string.digits:
        pieces.setdefault("\u2581" + char, -9.0)
        pieces.setdefault(char, -10.0)
    for char in ".,!?'-\"":
        pieces.setdefault(char, -10.0)
    return T5Tokenizer(vocab=list(pieces.items()), extra_ids=0)


# ---------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------

TEXT_DIM = 32
"""Hidden size of both tiny text encoders (the denoisers' text input width)."""
LATENT_CHANNELS = 4
"""VAE latent channels (16 in the real models)."""


def _vae_config(**extra) -> dict:
    """The smallest channel list the Wan-style VAEs take: 8x spatial, 4x temporal compression."""
    return {"base_dim": 8, "z_dim": LATENT_CHANNELS, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
            "attn_scales": [], "temperal_downsample": [False, True, True],
            "latents_mean": [0.1, -0.2, 0.3, 0.0], "latents_std": [1.5, 2.0, 0.5, 1.0], **extra}


def _write_index(path: Path, pipeline: str, components: dict, **extra) -> None:
    import diffusers

    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__, **extra, **components}
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _perturb(module: torch.nn.Module) -> None:
    """Give zero-initialised modulations a small random value, so the output depends on every input."""
    with torch.no_grad():
        for param in module.parameters():
            if param.abs().max() == 0:
                param.normal_(std=0.02)


def save_qwen_image(path: str | Path, seed: int = 0, num_layers: int = 1) -> Path:
    """Write a tiny random ``QwenImagePipeline`` folder (a few hundred thousand parameters)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": TEXT_DIM, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 512, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": TEXT_DIM, "fullatt_block_indexes": [0]},
    )
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path / "text_encoder")
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6),
    )
    _perturb(transformer)
    transformer.save_pretrained(path / "transformer")
    AutoencoderKLQwenImage(**_vae_config()).save_pretrained(path / "vae")
    FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                    time_shift_type="exponential").save_pretrained(path / "scheduler")
    _write_index(path, "QwenImagePipeline", {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    })
    return path


def save_wan(path: str | Path, seed: int = 0, **index_extra) -> Path:
    """Write a tiny random ``WanPipeline`` folder (Wan 2.1 text-to-video layout).

    ``index_extra`` goes into ``model_index.json`` (e.g. ``boundary_ratio=0.875`` for a Wan 2.2
    two-transformer folder).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = t5_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
    ))
    encoder.save_pretrained(path / "text_encoder")
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=1,
    )
    _perturb(transformer)
    transformer.save_pretrained(path / "transformer")
    AutoencoderKLWan(**_vae_config()).save_pretrained(path / "vae")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                            num_train_timesteps=1000).save_pretrained(path / "scheduler")
    _write_index(path, "WanPipeline", {
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }, boundary_ratio=None, expand_timesteps=False, **index_extra)
    return path

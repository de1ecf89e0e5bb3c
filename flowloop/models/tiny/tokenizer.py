"""A word-level fast tokenizer for the shapes world, built with the `tokenizers` library.

The embedded model's prompts come from a small closed grammar, so one id per word is all the
text side needs. Building it with `tokenizers` and loading it back as a transformers
``PreTrainedTokenizerFast`` keeps the agent loop's code path identical to real models: it
calls ``apply_chat_template`` and gets ids, whatever the model.
"""

from __future__ import annotations

from pathlib import Path

PAD, UNK, BOS = "[PAD]", "[UNK]", "[BOS]"

# The user's words follow a start token; the template ignores system and assistant turns because
# the model was trained on bare prompts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'user' %} {{ message['content'] }}{% endif %}{% endfor %}"
)


def build_tokenizer(words: list[str], model_max_length: int = 16):
    """Return a ``PreTrainedTokenizerFast`` whose vocabulary is the special tokens plus ``words``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, UNK, BOS, *dict.fromkeys(w.lower() for w in words)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        padding_side="right",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer, folder: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) to ``folder``."""
    tokenizer.save_pretrained(str(folder))

"""Prompt text -> token ids, one way for everyone: the agent loop, the engine's empty prompt, tests.

Every model's tokenizer carries a chat template (the tiny model's "[BOS] prompt", Qwen-Image's
system prompt, T5's "prompt</s>"), so the ids the agent loop sends are exactly the ids the
model's own pipeline would encode.
"""

from __future__ import annotations

import torch


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Chat template + tokenizer -> ``[L]`` int64 ids, unpadded.

    Call it on the event-loop thread only: a fast tokenizer used from two threads at once
    raises "Already borrowed". A word the tokenizer maps to its unknown token is an error here,
    not a silently different prompt.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        unknown = unknown_words(tokenizer, text)
        raise ValueError(f"prompt {text!r} has words the tokenizer does not know: {unknown}")
    return torch.tensor(ids, dtype=torch.long)


def unknown_words(tokenizer, text: str) -> list[str]:
    """Words of ``text`` the tokenizer maps to its unknown token (for a clear error upstream)."""
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return [text[a:b] for (a, b), tok in zip(encoding.offsets, encoding.ids) if tok == tokenizer.unk_token_id]

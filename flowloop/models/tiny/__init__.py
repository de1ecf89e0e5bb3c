"""The embedded shapes model: word-level tokenizer, tiny text encoder, pixel-space DiT."""

from flowloop.models.tiny.denoiser import TinyDiT
from flowloop.models.tiny.model import TinyFlowModel
from flowloop.models.tiny.text_encoder import TinyTextEncoder
from flowloop.models.tiny.tokenizer import build_tokenizer

__all__ = ["TinyDiT", "TinyFlowModel", "TinyTextEncoder", "build_tokenizer"]

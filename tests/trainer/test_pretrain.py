import json

import torch

from flowloop.cli import main
from flowloop.models import load_flow_model
from flowloop.tasks.shapes.prompts import HELDOUT_COLOUR_SHAPES, is_heldout_composition
from flowloop.trainer.pretrain import render_dataset


def test_render_dataset_is_deterministic_and_train_only():
    from flowloop.tasks import shapes

    a, prompts = render_dataset(40, 32, seed=3, workers=1)
    b, _ = render_dataset(40, 32, seed=3, workers=1)
    assert a.shape == (40, 3, 32, 32) and a.dtype == torch.uint8
    assert torch.equal(a, b)
    heldout = {p for c in shapes.CATEGORIES for p in shapes.split_prompts("heldout", c)}
    assert not heldout & set(prompts)
    assert not any(is_heldout_composition(shapes.parse_prompt(p)) for p in prompts)
    # What the pictures show, read back, holds no held-out pair either (colours a prompt leaves free).
    for image in a.permute(0, 2, 3, 1).numpy():
        seen = shapes.verify(image, "a circle").details["objects"]
        assert not any((o["colour"], o["shape"]) in HELDOUT_COLOUR_SHAPES for o in seen)


def test_pretrain_cli_learns_and_saves(tmp_path):
    out = tmp_path / "run"
    code = main(["pretrain", f"out={out}", "steps=80", "batch_size=32", "dataset_size=256", "render_workers=1",
                 "eval_every=40", "eval_samples_per_prompt=1", "eval_num_steps=2", "hidden_size=32", "depth=2",
                 "num_heads=2", "text_hidden_size=32", "text_depth=1", "warmup_steps=10", "lr=3e-3"])
    assert code == 0
    log = [json.loads(line) for line in (out / "pretrain_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [40, 80] and 0.0 <= log[-1]["accuracy"] <= 1.0
    assert log[1]["loss"] < 0.9 * log[0]["loss"]  # the rectified-flow loss falls
    model = load_flow_model(out / "model")
    assert model.transformer.config.hidden_size == 32
    assert (out / "checkpoints" / "step_80" / "model_index.json").is_file()


def test_init_from_a_model_of_fewer_words_keeps_what_it_knows(tmp_path):
    """A model trained before the world grew starts pretraining with its weights and the rows of
    the words it knows; the new words get rows of their own."""
    from flowloop.models.tiny import TinyDiT, TinyFlowModel, TinyTextEncoder, build_tokenizer
    from flowloop.tasks import shapes
    from flowloop.trainer.pretrain import PretrainConfig, initial_model

    old_words = [w for w in shapes.VOCABULARY if w not in ("star", "stars", "pink")]
    tokenizer = build_tokenizer(old_words)
    torch.manual_seed(0)
    old = TinyFlowModel(tokenizer, TinyTextEncoder(vocab_size=len(tokenizer), hidden_size=32, depth=1, num_heads=2),
                        TinyDiT(sample_size=32, patch_size=4, hidden_size=32, depth=1, num_heads=2, text_dim=32))
    old.save_pretrained(tmp_path / "old", dtype=torch.float32)

    model = initial_model(PretrainConfig(init=str(tmp_path / "old")))
    assert model.tokenize(["a pink star"])[0].shape[1] > 0
    new_vocab, old_vocab = model.tokenizer.get_vocab(), tokenizer.get_vocab()
    assert {"star", "stars", "pink"} <= set(new_vocab) and len(new_vocab) == len(old_vocab) + 3
    new_rows, old_rows = model.text_encoder.token_embedding.weight, old.text_encoder.token_embedding.weight
    for word in ("red", "circle", "above", "[BOS]"):
        assert torch.equal(new_rows[new_vocab[word]], old_rows[old_vocab[word]])
    for name, value in old.transformer.state_dict().items():
        assert torch.equal(model.transformer.state_dict()[name], value), name
    new_text, old_text = model.text_encoder.state_dict(), old.text_encoder.state_dict()
    for name, value in old_text.items():
        if name != "token_embedding.weight":
            assert torch.equal(new_text[name], value), name

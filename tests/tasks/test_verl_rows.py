"""verl's data contract: its dataset rows, column names and arrays train as they are."""

import json

import numpy as np
import pytest
import torch

from flowloop.agent_loop import AgentLoopManager
from flowloop.models import load_flow_model
from flowloop.protocol import Batch
from flowloop.reward.registry import build_reward, register_reward
from flowloop.tasks.prompt_file import load_prompt_file
from flowloop.trainer.recipe import run
from tests.agent_loop.helpers import small_config
from tests.trainer.test_recipe import brightness, metrics, tiny_config


@register_reward("test_bright_plus_10")
def bright_plus_10(images, prompts, metadata):
    values, infos = brightness(images, prompts, metadata)
    return [v + 10 for v in values], infos


def verl_row(text: str, source: str, **extra) -> dict:
    return {"prompt": [{"role": "user", "content": text}], "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": text}, "extra_info": {"index": 0}, **extra}


def write_rows(rows: list[dict], path):
    if path.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_verl_file_with_two_data_sources_trains_with_a_reward_each(tiny_model_dir, tmp_path, suffix):
    rows = [verl_row(t, "shapes_a", category="shapes_a", raw_negative_prompt=None) for t in ("a red circle", "two squares")]
    rows += [verl_row(t, "shapes_b", category="shapes_b", raw_negative_prompt="a square") for t in ("a triangle", "three circles")]
    path = tmp_path / f"train{suffix}"
    write_rows(rows, path)
    loaded = load_prompt_file(path)
    assert loaded[0]["raw_prompt"] == [{"role": "user", "content": "a red circle"}] and loaded[0]["data_source"] == "shapes_a"
    run(tiny_config(tiny_model_dir, tmp_path / "runs", "trainer.total_steps=3", f"data.prompt_file={path}",
                    "data.val_train_prompts=4", "rollout.reward.name=by_data_source", "rollout.pipeline.guidance_scale=2",
                    "rollout.reward.kwargs={routes: {shapes_a: test_brightness, shapes_b: test_bright_plus_10}}"),
        log=lambda _: None)
    trained = [r for r in metrics(tmp_path / "runs" / "shapes") if "reward/mean" in r]
    assert len(trained) == 3
    for row in trained:
        for key, value in row.items():
            if key.startswith("reward/category/shapes_a/"):
                assert value < 1
            if key.startswith("reward/category/shapes_b/"):
                assert value > 10


def test_an_unrouted_data_source_is_named():
    fn = build_reward("by_data_source", {"routes": {"a": "test_brightness"}})
    import asyncio

    with pytest.raises(ValueError, match=r"no route for data_source \['c'\]; routes: \['a'\]"):
        asyncio.run(fn(torch.rand(2, 3, 8, 8), ["x", "y"], [{"data_source": "a"}, {"data_source": "c"}]))


def test_verls_literal_input_object_arrays_and_raw_negative_prompt():
    model = load_flow_model(None)
    config = small_config(reward=None)
    config.pipeline.guidance_scale = 2.0  # true CFG: the negative prompt is used
    manager = AgentLoopManager.create(config, model)
    try:
        messages = [[{"role": "user", "content": "a red circle"}], [{"role": "user", "content": "two squares"}]]
        batch = Batch.from_dict(non_tensors={
            "raw_prompt": np.array(messages, dtype=object), "uid": np.array(["u0", "u1"], dtype=object),
            "raw_negative_prompt": np.array(["a square", "a square"], dtype=object)}, meta_info={"global_steps": 1})
        out = manager.generate_sequences(batch)
        assert len(out) == 2 and list(out["negative_prompt"]) == ["a square", "a square"]
        batch = Batch.from_dict(non_tensors={"raw_prompt": ["a red circle"], "neg_prompt": ["a square"]},
                                meta_info={"global_steps": 1})
        with pytest.raises(ValueError, match=r"\['neg_prompt'\] look like a negative prompt but are not read"):
            manager.generate_sequences(batch)
    finally:
        manager.shutdown()

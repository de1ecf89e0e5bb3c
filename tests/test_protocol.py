"""Batch: construction, row operations, key operations, padding and files, on real tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowloop.protocol import Batch, pad_batch_to_multiple, pad_to_length, to_object_array, unpad


def make_batch(n: int = 5, seed: int = 0) -> Batch:
    """A rollout-shaped batch: ids, an image and a 5-D video tensor, log-probs, dicts and lists per row."""
    g = torch.Generator().manual_seed(seed)
    return Batch.from_dict(
        tensors={
            "prompts": torch.randint(0, 100, (n, 6), generator=g),  # [n, L]
            "responses": torch.rand(n, 3, 4, 4, generator=g),  # [n, C, H, W]
            "video": torch.rand(n, 2, 3, 4, 4, generator=g),  # [n, T, C, H, W]
            "rollout_log_probs": torch.randn(n, 3, generator=g),  # [n, W]
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(n)],
            "raw_prompt": [[{"role": "user", "content": f"prompt {i}"}] for i in range(n)],
            "reward_extra_info": [{"acc": float(i), "tags": [i, i + 1]} for i in range(n)],
            "sizes": [[i] * 2 for i in range(n)],  # equal-length lists: must not become a 2-D array
            "tokens": [list(range(i % 3)) for i in range(n)],  # ragged lists
        },
        meta_info={"metrics": [{"generate": 0.1 * i} for i in range(n)], "global_steps": 3, "validate": False},
    )


def assert_batches_equal(a: Batch, b: Batch) -> None:
    assert len(a) == len(b)
    assert sorted(a.tensors.keys()) == sorted(b.tensors.keys())
    for key in a.tensors.keys():
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert a.non_tensors.keys() == b.non_tensors.keys()
    for key, values in a.non_tensors.items():
        assert values.dtype == object and values.shape == (len(a),), key
        assert list(values) == list(b.non_tensors[key]), key
    assert a.meta_info == b.meta_info


# ---- construction ------------------------------------------------------------------------------


def test_from_dict_builds_1d_object_arrays_and_exposes_keys():
    batch = make_batch(4)
    assert len(batch) == 4
    assert batch.tensors.batch_size == torch.Size([4])
    assert batch["sizes"].shape == (4,) and batch["sizes"][2] == [2, 2]
    assert batch["reward_extra_info"][1] == {"acc": 1.0, "tags": [1, 2]}
    assert "video" in batch and "uid" in batch and "global_steps" not in batch and "nope" not in batch
    tensor_keys = ["prompts", "responses", "video", "rollout_log_probs"]
    assert batch.keys() == tensor_keys + ["uid", "raw_prompt", "reward_extra_info", "sizes", "tokens"]
    assert batch["video"].shape == (4, 2, 3, 4, 4)
    text = repr(batch)
    assert "video: [4, 2, 3, 4, 4] float32" in text and "uid" in text and "global_steps" in text
    with pytest.raises(KeyError, match="nope"):
        batch["nope"]


def test_from_dict_names_the_key_with_the_wrong_length():
    with pytest.raises(ValueError, match=r"tensor 'b' has 3 rows but tensor 'a' has 4"):
        Batch.from_dict({"a": torch.zeros(4, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non-tensor 'uid' has 2 rows but tensor 'a' has 4"):
        Batch.from_dict({"a": torch.zeros(4)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match="'raw_prompt'"):
        Batch.from_dict(non_tensors={"raw_prompt": "a single string is not one item per row"})
    with pytest.raises(ValueError, match="'s'"):
        Batch.from_dict({"s": torch.tensor(1.0)})


def test_non_tensor_only_batch_and_numeric_arrays():
    batch = Batch.from_dict(non_tensors={"n": np.arange(3, dtype=np.int32), "m": np.zeros((3, 2))})
    assert len(batch) == 3
    assert batch["n"].dtype == object and list(batch["n"]) == [0, 1, 2]
    assert batch["m"].shape == (3,) and batch["m"][0].shape == (2,)  # rows of a 2-D array stay whole
    assert to_object_array([[1, 2], [3, 4]]).shape == (2,)
    with pytest.raises(ValueError, match="'info'"):
        to_object_array({"a": 1}, key="info")  # a dict is one value, not one per row


def test_setitem_validates_and_routes():
    batch = make_batch(3)
    batch["rm_scores"] = torch.ones(3, 1)
    batch["agent_name"] = ["single_turn"] * 3
    assert batch["rm_scores"].shape == (3, 1) and batch["agent_name"].dtype == object
    with pytest.raises(ValueError, match=r"'bad' has 2 rows but the batch has 3"):
        batch["bad"] = torch.ones(2)
    with pytest.raises(ValueError, match="'uid' is already a non-tensor"):
        batch["uid"] = torch.ones(3)


# ---- row operations ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_chunk_then_concat_round_trips(k):
    batch = make_batch(5)
    parts = batch.chunk(k)
    assert len(parts) == k
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 5 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [len(p.meta_info["metrics"]) for p in parts] == sizes  # per-row metrics travel with rows
    assert_batches_equal(Batch.concat(parts), batch)


def test_chunk_rejects_more_parts_than_rows():
    with pytest.raises(ValueError, match="3 rows into 4"):
        make_batch(3).chunk(4)


def test_split_sizes_and_round_trip():
    batch = make_batch(5)
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert list(parts[2]["uid"]) == ["u4"]
    assert_batches_equal(Batch.concat(parts), batch)


def test_concat_merges_metrics_and_keeps_first_meta():
    a, b = make_batch(2), make_batch(3, seed=1)
    b.meta_info["global_steps"] = 99
    merged = Batch.concat([a, b])
    assert merged.meta_info["metrics"] == a.meta_info["metrics"] + b.meta_info["metrics"]
    assert merged.meta_info["global_steps"] == 3
    assert torch.equal(merged["video"], torch.cat([a["video"], b["video"]]))


def test_concat_errors_name_the_keys():
    a, b = make_batch(2), make_batch(2)
    b["rm_scores"] = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"extra keys \['rm_scores'\]"):
        Batch.concat([a, b])
    c = make_batch(2).select(non_tensor_keys=["uid"])
    with pytest.raises(ValueError, match=r"lacks keys \['raw_prompt', 'reward_extra_info', 'sizes', 'tokens'\]"):
        Batch.concat([a, c])
    d = Batch.from_dict({"prompts": torch.zeros(2, 7)}), Batch.from_dict({"prompts": torch.zeros(2, 6)})
    with pytest.raises(ValueError, match="'prompts'"):
        Batch.concat(list(d))
    no_metrics = make_batch(2)
    del no_metrics.meta_info["metrics"]
    with pytest.raises(ValueError, match="metrics"):
        Batch.concat([a, no_metrics])


def test_repeat_interleave_and_tile_order():
    batch = make_batch(3).select(tensor_keys=["prompts"], non_tensor_keys=["uid"], meta_keys=["metrics"])
    inter = batch.repeat(2, interleave=True)
    assert list(inter["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert torch.equal(inter["prompts"], batch["prompts"][[0, 0, 1, 1, 2, 2]])
    assert [m["generate"] for m in inter.meta_info["metrics"]] == pytest.approx([0, 0, 0.1, 0.1, 0.2, 0.2])
    tiled = batch.repeat(2, interleave=False)
    assert list(tiled["uid"]) == ["u0", "u1", "u2", "u0", "u1", "u2"]
    assert torch.equal(tiled["prompts"], batch["prompts"][[0, 1, 2, 0, 1, 2]])


@pytest.mark.parametrize(
    "index, rows",
    [
        (slice(1, 4), [1, 2, 3]),
        ([4, 0, 0], [4, 0, 0]),
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([2, -1]), [2, 4]),
        (torch.tensor([True, False, False, True, False]), [0, 3]),
        ([], []),
    ],
)
def test_index_selects_rows_everywhere(index, rows):
    batch = make_batch(5)
    picked = batch[index]
    assert isinstance(picked, Batch) and len(picked) == len(rows)
    assert list(picked["uid"]) == [f"u{r}" for r in rows]
    assert torch.equal(picked["video"], batch["video"][rows])
    assert list(picked["sizes"]) == [[r, r] for r in rows]
    assert picked.meta_info["metrics"] == [batch.meta_info["metrics"][r] for r in rows]
    assert picked.meta_info["global_steps"] == 3


def test_index_errors():
    batch = make_batch(3)
    with pytest.raises(IndexError, match="3 rows"):
        batch[[0, 3]]
    with pytest.raises(TypeError):
        batch[0]
    with pytest.raises(IndexError, match="boolean mask"):
        batch[torch.tensor([True, False])]


def test_row_selection_does_not_modify_the_source():
    batch = make_batch(4)
    part = batch[1:3]
    part["new"] = torch.zeros(2)
    part.meta_info["validate"] = True
    assert "new" not in batch and batch.meta_info["validate"] is False


# ---- key operations ----------------------------------------------------------------------------


def test_select_keeps_only_the_listed_keys():
    batch = make_batch(3)
    small = batch.select(tensor_keys=["video"], non_tensor_keys=["uid"], meta_keys=["global_steps"])
    assert small.keys() == ["video", "uid"] and small.meta_info == {"global_steps": 3}
    assert torch.equal(small["video"], batch["video"])
    everything = batch.select()
    assert_batches_equal(everything, batch)
    with pytest.raises(KeyError, match="missing_key"):
        batch.select(tensor_keys=["missing_key"])


def test_union_merges_and_rejects_conflicts():
    batch = make_batch(3)
    left = batch.select(tensor_keys=["prompts", "video"], non_tensor_keys=["uid", "sizes"], meta_keys=["metrics"])
    right = batch.select(tensor_keys=["prompts", "responses"], non_tensor_keys=["uid"], meta_keys=["global_steps"])
    merged = left.union(right)
    assert sorted(merged.keys()) == sorted(["prompts", "video", "responses", "uid", "sizes"])
    assert merged.meta_info == {"metrics": batch.meta_info["metrics"], "global_steps": 3}
    assert torch.equal(merged["responses"], batch["responses"])

    changed = right.select()
    changed["prompts"] = right["prompts"] + 1
    with pytest.raises(ValueError, match="'prompts'"):
        left.union(changed)
    other_uid = Batch.from_dict(non_tensors={"uid": ["u0", "u1", "zz"]})
    with pytest.raises(ValueError, match="'uid'"):
        left.union(other_uid)
    with pytest.raises(ValueError, match="3 and 2 rows"):
        left.union(batch[:2])


# ---- padding -----------------------------------------------------------------------------------


def test_pad_to_length_left_and_right():
    ids = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6, 7, 8, 9])]
    left = pad_to_length(ids, 5, pad_value=0, side="left")
    assert left.tolist() == [[0, 0, 1, 2, 3], [0, 0, 0, 0, 4], [5, 6, 7, 8, 9]]
    assert left.dtype == torch.int64
    embeds = [torch.ones(2, 4), torch.full((3, 4), 2.0)]  # [L_i, D]
    right = pad_to_length(embeds, 5, pad_value=0.0, side="right")
    assert right.shape == (2, 5, 4)
    assert right[0, :2].eq(1).all() and right[0, 2:].eq(0).all() and right[1, :3].eq(2).all()
    assert right[1, 3:].eq(0).all()
    along_last = pad_to_length([torch.ones(2, 1), torch.ones(2, 3)], 3, pad_value=-1, side="left", dim=-1)
    assert along_last[0].tolist() == [[-1, -1, 1], [-1, -1, 1]]


def test_pad_to_length_errors_name_the_row():
    with pytest.raises(ValueError, match=r"row 1 has length 6 along dim 0, more than the pad length 4"):
        pad_to_length([torch.ones(2), torch.ones(6)], 4, pad_value=0)
    with pytest.raises(ValueError, match=r"row 1 has shape \(2, 5\)"):
        pad_to_length([torch.ones(2, 4), torch.ones(2, 5)], 4, pad_value=0)
    with pytest.raises(ValueError, match="side"):
        pad_to_length([torch.ones(2)], 4, pad_value=0, side="middle")


@pytest.mark.parametrize("n, multiple, expected_pad", [(5, 4, 3), (8, 4, 0), (3, 8, 5), (5, 1, 0)])
def test_pad_batch_to_multiple_and_unpad(n, multiple, expected_pad):
    batch = make_batch(n)
    padded, pad_count = pad_batch_to_multiple(batch, multiple)
    assert pad_count == expected_pad and len(padded) % multiple == 0
    assert list(padded["uid"][n:]) == [f"u{i % n}" for i in range(pad_count)]  # repeats rows from the start
    assert len(padded.meta_info["metrics"]) == len(padded)
    assert [len(part) for part in padded.chunk(multiple)] == [len(padded) // multiple] * multiple
    assert_batches_equal(unpad(padded, pad_count), batch)
    with pytest.raises(ValueError, match="padding rows"):
        unpad(batch, n + 1)


# ---- files and devices -------------------------------------------------------------------------


def test_save_load_round_trip_is_atomic(tmp_path):
    batch = make_batch(4)
    path = tmp_path / "step_3" / "batch.pt"
    batch[1:3].save(path)
    batch.save(path)  # overwrites in place
    assert [p.name for p in path.parent.iterdir()] == ["batch.pt"]  # no temp file left behind
    loaded = Batch.load(path)
    assert_batches_equal(loaded, batch)
    assert loaded.meta_info["metrics"][3] == {"generate": pytest.approx(0.3)}


def test_save_of_a_slice_writes_only_its_rows(tmp_path):
    big = Batch.from_dict({"x": torch.zeros(1000, 256)})
    big[:1].save(tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < 100_000  # not the whole 1 MB storage


def test_failed_save_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "b.pt"
    good = make_batch(2)
    good.save(path)
    bad = Batch.from_dict({"x": torch.zeros(2)}, {"fn": [lambda: None, 1]})  # a lambda cannot be pickled
    with pytest.raises(Exception):
        bad.save(path)
    assert list(tmp_path.iterdir()) == [path]
    assert_batches_equal(Batch.load(path), good)


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing.pt"
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        Batch.load(missing)
    corrupt = tmp_path / "corrupt.pt"
    make_batch(2).save(corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt.pt"):
        Batch.load(corrupt)
    foreign = tmp_path / "foreign.pt"
    torch.save({"x": torch.zeros(1)}, foreign)
    with pytest.raises(ValueError, match="foreign.pt"):
        Batch.load(foreign)


def test_to_device_returns_an_independent_batch():
    batch = make_batch(2)
    moved = batch.to("cpu")
    moved["extra"] = torch.zeros(2)
    assert "extra" not in batch
    assert_batches_equal(moved.select(tensor_keys=list(batch.tensors.keys())), batch)

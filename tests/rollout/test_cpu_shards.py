"""CPU shards: a large batch runs as slices on their own threads, each with its share of the
intra-op threads (`RolloutEngine(cpu_shards=...)`, `flowloop.compute.shard_executor`)."""

import threading

import pytest
import torch

from flowloop.compute import shard_executor
from flowloop.rollout import AUTO_SHARD_MAX_THREADS, MIN_SHARD_ROWS, RolloutEngine
from tests.rollout.helpers import assert_same_samples, mixed_requests


def test_slices_give_the_unsliced_results_in_request_order(model):
    requests = mixed_requests(model, 3 * MIN_SHARD_ROWS + 2)
    whole = RolloutEngine(model, cpu_shards=1).sample(requests)
    sliced = RolloutEngine(model, cpu_shards=3).sample(requests)
    assert [o.metrics["cpu_shards"] for o in (whole[0], sliced[0])] == [1.0, 3.0]
    assert [o.request_id for o in sliced] == [r.request_id for r in requests]
    for a, b in zip(whole, sliced):  # on the 2-core CI machine bitwise equal: every slice has >= 4 rows
        assert_same_samples(a, b)


@pytest.mark.parametrize("rows, cpu_shards, slices", [
    (2 * MIN_SHARD_ROWS, 2, 2),
    (2 * MIN_SHARD_ROWS - 1, 2, 1),  # a slice would get fewer than MIN_SHARD_ROWS rows
    (1, 4, 1),
    (3 * MIN_SHARD_ROWS, 2, 2),
    (4 * MIN_SHARD_ROWS, 1, 1),
])
def test_how_many_slices_a_batch_runs_as(model, rows, cpu_shards, slices):
    outputs = RolloutEngine(model, cpu_shards=cpu_shards).sample(mixed_requests(model, rows))
    assert {o.metrics["cpu_shards"] for o in outputs} == {float(slices)}


def test_shard_threads_keep_their_thread_count_and_leave_the_default_alone():
    before = torch.get_num_threads()
    pool = shard_executor(2, 1)

    def busy_then_count() -> int:
        torch.ones(1 << 20).sum()  # a parallel op: a thread's first one resets its count to the default
        return torch.get_num_threads()

    assert [pool.submit(busy_then_count).result() for _ in range(4)] == [1] * 4
    assert torch.get_num_threads() == before
    seen = []
    fresh = threading.Thread(target=lambda: seen.append(busy_then_count()))
    fresh.start()
    fresh.join()
    assert seen == [before]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_cpu_shards_is_a_value_error(model, value):
    with pytest.raises(ValueError, match="cpu_shards"):
        RolloutEngine(model, cpu_shards=value)


@pytest.mark.parametrize("threads, slices", [(2, 2), (AUTO_SHARD_MAX_THREADS + 2, 1)])
def test_auto_slices_only_on_small_cpus(model, threads, slices):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outputs = RolloutEngine(model, cpu_shards=None).sample(mixed_requests(model, 4 * MIN_SHARD_ROWS))
    finally:
        torch.set_num_threads(before)
    assert outputs[0].metrics["cpu_shards"] == float(slices)


def test_an_engine_starts_no_threads_unless_asked(model):
    """The library default is one slice: no shard pool, nothing process-wide touched."""
    before = {t.name for t in threading.enumerate()}
    threads = torch.get_num_threads()
    outputs = RolloutEngine(model).sample(mixed_requests(model, 4 * MIN_SHARD_ROWS))
    assert outputs[0].metrics["cpu_shards"] == 1.0
    assert torch.get_num_threads() == threads
    assert not {t.name for t in threading.enumerate()} - before - {"flowloop-compute_0"}

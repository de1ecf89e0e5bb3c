import asyncio

import pytest

from flowloop.rollout import RolloutServer
from tests.rollout.helpers import mixed_requests, request

NEVER_MS = 600_000.0
"""A ``max_wait_ms`` no test waits out: batches run only when full or flushed."""


async def _until(condition, timeout=10.0):
    """Poll the event loop until ``condition()`` holds (the engine runs in a worker thread)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.002)


def test_concurrent_requests_are_batched_without_changing_results(engine, model):
    requests = mixed_requests(model, 12)

    async def main():
        server = RolloutServer(engine, max_batch_size=4, max_wait_ms=50)
        outputs = await asyncio.gather(*(server.generate(r) for r in requests))
        metrics = server.metrics()
        await server.stop()
        return outputs, metrics

    outputs, metrics = asyncio.run(main())
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert metrics["num_completed"] == 12 and metrics["num_outstanding"] == 0
    assert metrics["mean_batch_size"] > 1 and metrics["max_batch_size_seen"] <= 4
    assert metrics["samples_per_s"] > 0 and metrics["mean_queue_time_s"] >= 0
    for req, out in zip(requests, outputs):
        alone = engine.sample([req])[0]
        assert (alone.log_probs - out.log_probs).abs().max() <= 1e-6
        assert (alone.diffusion_output - out.diffusion_output).abs().max() <= 1e-5
        assert out.metrics["queue_time"] >= 0 and 1 <= out.metrics["batch_size"] <= 4


def test_incompatible_requests_run_in_separate_batches(engine, model):
    requests = mixed_requests(model, 4) + mixed_requests(model, 4, num_inference_steps=4, sde_window_range=(0, 3))
    for k, r in enumerate(requests):
        r.request_id = f"m{k}"

    async def main():
        server = RolloutServer(engine, max_batch_size=16, max_wait_ms=NEVER_MS)
        calls = [asyncio.create_task(server.generate(r)) for r in requests]
        await server.flush([r.request_id for r in requests])
        outputs = await asyncio.wait_for(asyncio.gather(*calls), 60)
        return outputs, server.metrics()

    outputs, metrics = asyncio.run(main())
    assert [o.log_probs.shape[0] for o in outputs] == [2] * 8
    assert metrics["num_batches"] == 2 and metrics["mean_batch_size"] == 4


def test_a_flush_runs_exactly_its_requests_whenever_they_arrive(engine, model):
    """No clock: each flush becomes its own batch once all of its requests are queued, even when
    the flush comes first (Ray may deliver it first) and requests of another flush sit between."""
    requests = mixed_requests(model, 7)
    first, second = [r.request_id for r in requests[:4]], [r.request_id for r in requests[4:]]

    async def main():
        server = RolloutServer(engine, max_batch_size=16, max_wait_ms=NEVER_MS)
        await server.flush(first)
        calls = [asyncio.create_task(server.generate(r)) for r in requests[::2]]  # r0 r2 r4 r6
        await asyncio.sleep(0.05)
        assert server.metrics()["num_batches"] == 0  # r1, r3 still missing; r4, r6 not flushed
        calls += [asyncio.create_task(server.generate(r)) for r in requests[1::2]]
        await server.flush(second)
        outputs = await asyncio.wait_for(asyncio.gather(*calls), 60)
        return {o.request_id: o for o in outputs}, server.metrics()

    outputs, metrics = asyncio.run(main())
    assert metrics["num_batches"] == 2
    assert [outputs[i].metrics["batch_size"] for i in first + second] == [4.0] * 4 + [3.0] * 3


def test_an_aborted_request_does_not_hold_its_flush_back(engine, model):
    requests = mixed_requests(model, 3)

    async def main():
        server = RolloutServer(engine, max_batch_size=16, max_wait_ms=NEVER_MS)
        calls = [asyncio.create_task(server.generate(r)) for r in requests[::2]]  # r1 never arrives
        await asyncio.sleep(0)
        await server.flush([r.request_id for r in requests])
        await asyncio.sleep(0.05)
        assert server.metrics()["num_batches"] == 0
        calls.append(asyncio.create_task(server.generate(requests[1])))
        await asyncio.sleep(0)
        server.abort(requests[1].request_id)
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60), server.metrics()

    (a, c, b), metrics = asyncio.run(main())
    assert isinstance(b, asyncio.CancelledError) and a.metrics["batch_size"] == c.metrics["batch_size"] == 2.0
    assert metrics["num_batches"] == 1


def test_a_bad_request_fails_only_its_own_call(engine, model):
    good = mixed_requests(model, 6)
    bad = request(model, "bad", height=18, width=18)

    async def main():
        server = RolloutServer(engine, max_batch_size=8, max_wait_ms=20)
        results = await asyncio.gather(*(server.generate(r) for r in [*good[:3], bad, *good[3:]]), return_exceptions=True)
        after = await server.generate(request(model, "after", seed=1))  # the server goes on
        return results, after, server.metrics()

    results, after, metrics = asyncio.run(main())
    assert isinstance(results[3], ValueError) and "height" in str(results[3])
    assert [r.request_id for r in results[:3] + results[4:]] == [r.request_id for r in good]
    assert after.request_id == "after"
    assert metrics["num_rejected"] == 1 and metrics["num_failed"] == 0 and metrics["num_completed"] == 7


def test_abort_cancels_only_that_queued_request(engine, model):
    requests = mixed_requests(model, 3)

    async def main():
        server = RolloutServer(engine, max_batch_size=8, max_wait_ms=1)
        await server.pause()  # hold batches so all three stay queued
        tasks = [asyncio.create_task(server.generate(r)) for r in requests]
        await _until(lambda: server.num_outstanding == 3)
        assert server.abort("r1") and not server.abort("r1") and not server.abort("nope")
        server.resume()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, server.metrics()

    results, metrics = asyncio.run(main())
    assert isinstance(results[1], asyncio.CancelledError)
    assert [results[0].request_id, results[2].request_id] == ["r0", "r2"]
    assert metrics["num_aborted"] == 1 and metrics["num_completed"] == 2 and metrics["mean_batch_size"] == 2


def test_pause_holds_new_batches_until_resume(engine, model):
    requests = mixed_requests(model, 4)

    async def main():
        server = RolloutServer(engine, max_batch_size=4, max_wait_ms=1)
        await server.generate(request(model, "warm", seed=0))
        await server.pause()
        tasks = [asyncio.create_task(server.generate(r)) for r in requests]
        await asyncio.sleep(0.2)
        held = (server.metrics()["num_batches"], sum(t.done() for t in tasks), server.metrics()["num_queued"])
        server.resume()
        await asyncio.gather(*tasks)
        return held, server.metrics()

    (batches, done, queued), metrics = asyncio.run(main())
    assert (batches, done, queued) == (1, 0, 4)
    assert metrics["num_batches"] == 2 and metrics["num_completed"] == 5


def test_pause_waits_for_the_running_batch(engine, model):
    requests = mixed_requests(model, 8, num_inference_steps=30, sde_window_range=(0, 29))

    async def main():
        server = RolloutServer(engine, max_batch_size=8, max_wait_ms=1)
        tasks = [asyncio.create_task(server.generate(r)) for r in requests]
        await _until(lambda: server.metrics()["num_running"] > 0)
        await server.pause()
        state = (server.metrics()["num_running"], server.metrics()["num_batches"])
        await asyncio.gather(*tasks)
        return state

    running, batches = asyncio.run(main())
    assert (running, batches) == (0, 1)  # pause returned after the batch, not during it


def test_stop_cancels_queued_requests_and_refuses_new_ones(engine, model):
    async def main():
        server = RolloutServer(engine, max_batch_size=4, max_wait_ms=1)
        await server.pause()
        task = asyncio.create_task(server.generate(request(model, "q", seed=0)))
        await _until(lambda: server.num_outstanding == 1)
        await server.stop()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError, match="stopped"):
            await server.generate(request(model, "late", seed=0))

    asyncio.run(main())


def test_duplicate_request_id_is_rejected(engine, model):
    async def main():
        server = RolloutServer(engine, max_batch_size=4, max_wait_ms=1)
        await server.pause()
        first = asyncio.create_task(server.generate(request(model, "same", seed=0)))
        await _until(lambda: server.num_outstanding == 1)
        with pytest.raises(ValueError, match="request_id"):
            await server.generate(request(model, "same", seed=1))
        server.resume()
        return await first

    assert asyncio.run(main()).request_id == "same"


def test_server_arguments_are_checked(engine):
    with pytest.raises(ValueError, match="max_batch_size"):
        RolloutServer(engine, max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        RolloutServer(engine, max_wait_ms=-1)


def test_a_caller_that_gives_up_removes_its_queued_request(engine, model):
    async def main():
        server = RolloutServer(engine, max_batch_size=4, max_wait_ms=1)
        await server.pause()
        task = asyncio.create_task(server.generate(request(model, "gone", seed=0)))
        kept = asyncio.create_task(server.generate(request(model, "kept", seed=1)))
        await _until(lambda: server.num_outstanding == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.resume()
        out = await kept
        return out, server.metrics()

    out, metrics = asyncio.run(main())
    assert out.request_id == "kept"
    assert metrics["num_batches"] == 1 and metrics["mean_batch_size"] == 1 and metrics["num_outstanding"] == 0

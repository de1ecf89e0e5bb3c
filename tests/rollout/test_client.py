import asyncio

import pytest

from flowloop.rollout import RolloutClient, RolloutEngine, RolloutServer
from flowloop.rollout.types import StaleWeightsError
from tests.conftest import make_tiny_model
from tests.rollout.helpers import mixed_requests


@pytest.fixture(scope="module")
def engines():
    """Two replicas, each with its own copy of one model (same seed, same weights)."""
    return [RolloutEngine(make_tiny_model(seed=0)) for _ in range(2)]


async def _until(condition, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.002)


def test_routes_to_the_replica_with_fewest_outstanding_requests(engines):
    requests = mixed_requests(engines[0].model, 8)

    async def main():
        servers = [RolloutServer(e, max_batch_size=8, max_wait_ms=1) for e in engines]
        client = RolloutClient(servers)
        for server in servers:
            await server.pause()
        # 1. Five requests against two held replicas spread 3 / 2.
        first = [asyncio.create_task(client.generate(r)) for r in requests[:5]]
        await _until(lambda: client.num_outstanding == 5)
        spread = client.outstanding
        assert [s.num_outstanding for s in servers] == spread
        # 2. Replica 1 drains; the next three all go to it, the least loaded.
        servers[1].resume()
        await _until(lambda: client.outstanding[1] == 0)
        second = [asyncio.create_task(client.generate(r)) for r in requests[5:]]
        await _until(lambda: servers[1].metrics()["num_completed"] == 5)
        servers[0].resume()
        outputs = await asyncio.gather(*first, *second)
        return spread, outputs, client.outstanding, [s.metrics() for s in servers]

    spread, outputs, outstanding, metrics = asyncio.run(main())
    assert sorted(spread) == [2, 3]
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert outstanding == [0, 0]
    assert sorted(m["num_completed"] for m in metrics) == [3, 5]


def test_replicas_share_concurrent_load_without_changing_results(engines):
    requests = mixed_requests(engines[0].model, 12)

    async def main():
        client = RolloutClient([RolloutServer(e, max_batch_size=4, max_wait_ms=5) for e in engines])
        outputs = await asyncio.gather(*(client.generate(r) for r in requests))
        return outputs, client.outstanding, [s.metrics()["num_completed"] for s in client.replicas]

    outputs, outstanding, completed = asyncio.run(main())
    assert outstanding == [0, 0] and all(n > 0 for n in completed) and sum(completed) == 12
    for req, out in zip(requests, outputs):
        alone = engines[0].sample([req])[0]
        assert (alone.diffusion_output - out.diffusion_output).abs().max() <= 1e-5


def test_abort_goes_to_the_replica_that_holds_the_request(engines):
    requests = mixed_requests(engines[0].model, 4)

    async def main():
        client = RolloutClient([RolloutServer(e, max_wait_ms=1) for e in engines])
        await client.pause()
        tasks = [asyncio.create_task(client.generate(r)) for r in requests]
        await _until(lambda: client.num_outstanding == 4)
        assert await client.abort("r2") and not await client.abort("unknown")
        await client.resume()
        return await asyncio.gather(*tasks, return_exceptions=True), client.outstanding

    results, outstanding = asyncio.run(main())
    assert isinstance(results[2], asyncio.CancelledError)
    assert [results[k].request_id for k in (0, 1, 3)] == ["r0", "r1", "r3"]
    assert outstanding == [0, 0]


def test_needs_a_replica():
    with pytest.raises(ValueError, match="replica"):
        RolloutClient([])


@pytest.mark.slow
def test_ray_actor_replicas(engines):
    """The same client over Ray actors: ``ray.remote(RolloutServer)``, local cluster."""
    ray = pytest.importorskip("ray")
    requests = mixed_requests(engines[0].model, 6)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [ray.remote(RolloutServer).remote(RolloutEngine(make_tiny_model(seed=0)), 4, 5.0) for _ in range(2)]

        async def main():
            client = RolloutClient(actors)
            outputs = await asyncio.gather(*(client.generate(r) for r in requests))
            return outputs, client.outstanding

        outputs, outstanding = asyncio.run(main())
        metrics = ray.get([a.metrics.remote() for a in actors])
    finally:
        ray.shutdown()
    assert outstanding == [0, 0] and all(m["num_completed"] > 0 for m in metrics)
    for req, out in zip(requests, outputs):
        assert (engines[0].sample([req])[0].diffusion_output - out.diffusion_output).abs().max() <= 1e-5


def test_a_replica_with_stale_weights_hands_the_request_to_one_with_the_right_ones(engines):
    """Replica 0 missed the last weight update (as one restarted after a crash has): requests that
    name update 3 are refused there and sampled by replica 1, with the weights it loaded and the
    retry counted; a request no replica can serve fails with the reason."""
    model = engines[0].model
    weights = {k: v.clone() for k, v in model.trainable_module().state_dict().items()}

    async def main():
        servers = [RolloutServer(e, max_batch_size=4, max_wait_ms=1) for e in engines]
        await servers[0].update_weights(None, 2)
        await servers[1].update_weights(weights, 3)
        client = RolloutClient(servers)
        outputs = [await client.generate(r) for r in mixed_requests(model, 3, weight_version=3)]
        with pytest.raises(StaleWeightsError, match="needs the weights of update 4"):
            await client.generate(mixed_requests(model, 1, weight_version=4)[0])
        for server in servers:
            await server.stop()
        return outputs, servers

    outputs, servers = asyncio.run(main())
    assert [int(o.extra_fields["weight_version"]) for o in outputs] == [3, 3, 3]
    assert sum(o.metrics["retries"] for o in outputs) >= 1  # round-robin sends at least one to replica 0 first
    assert servers[0].metrics()["num_rejected"] >= 1 and servers[1].metrics()["num_completed"] == 3


def test_a_request_queued_across_a_weight_update_is_refused_not_sampled_with_the_new_weights(engines):
    """A request for update 1 still queued when the replica loads update 2 must not come back
    stamped 2: it fails with StaleWeightsError (the client would try another replica)."""
    model = engines[0].model

    async def main():
        server = RolloutServer(engines[0], max_batch_size=4, max_wait_ms=1)
        await server.update_weights(None, 1)
        await server.pause()
        queued = asyncio.create_task(server.generate(mixed_requests(model, 1, weight_version=1)[0]))
        await _until(lambda: server.num_outstanding == 1)
        await server.update_weights(None, 2)
        server.resume()  # the queued request's batch starts under update 2
        with pytest.raises(StaleWeightsError, match="moved on to 2 while it was queued"):
            await queued
        fresh = await server.generate(mixed_requests(model, 1, weight_version=2)[0])
        await server.stop()
        return fresh

    fresh = asyncio.run(main())
    assert int(fresh.extra_fields["weight_version"]) == 2

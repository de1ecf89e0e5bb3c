"""The process's one compute thread (`flowloop.compute`): rollout servers run their batches there
unless given an executor, and a nested call from that thread runs in place instead of deadlocking."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from flowloop.compute import run_compute
from flowloop.rollout import RolloutServer
from tests.rollout.helpers import request


class _ThreadRecordingEngine:
    """The real engine, noting which thread ran each batch."""

    def __init__(self, engine):
        self.engine = engine
        self.threads = []

    def validate(self, req):
        self.engine.validate(req)

    def sample(self, requests):
        self.threads.append(threading.current_thread().name)
        return self.engine.sample(requests)


def test_nested_run_compute_runs_in_place_on_the_compute_thread():
    outer, inner = run_compute(lambda: (threading.current_thread().name, run_compute(lambda: threading.current_thread().name)))
    assert outer == inner and outer.startswith("flowloop-compute")


def test_server_runs_batches_on_the_compute_thread_unless_given_an_executor(engine, model):
    async def serve(server):
        await server.generate(request(model, "a"))
        await server.stop()

    shared = _ThreadRecordingEngine(engine)
    asyncio.run(serve(RolloutServer(shared)))
    assert shared.threads == [run_compute(lambda: threading.current_thread().name)]

    own = _ThreadRecordingEngine(engine)
    with ThreadPoolExecutor(1, thread_name_prefix="replica-gpu1") as executor:
        asyncio.run(serve(RolloutServer(own, executor=executor)))
    assert own.threads[0].startswith("replica-gpu1")

"""The ``remote`` reward against a real `RewardServer` on loopback: same scores as local, batching,
timeouts, retries, and the ``flowloop serve-reward`` command."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from flowloop.reward import RewardSample, RewardWorker, build_reward, register_reward
from flowloop.reward.remote import decode_request, encode_request
from flowloop.reward.serve import RewardServer, parse_kwargs
from flowloop.tasks import shapes
from tests.reward.test_worker import score_all

SEEN_BATCHES: list[int] = []
RELEASE = threading.Event()


@register_reward("test_remote_value")
def metadata_value(images, prompts, metadata):
    """Each row's ``value``, so order is checkable; records the size of every call."""
    SEEN_BATCHES.append(len(prompts))
    if "boom" in prompts:
        raise RuntimeError("cannot score boom")
    return [float(m["value"]) for m in metadata], [{"prompt": p} for p in prompts]


@register_reward("test_remote_slow")
def slow(images, prompts, metadata):
    RELEASE.wait(timeout=10)  # held until the test has seen the client give up
    return [0.0] * len(prompts), [{} for _ in prompts]


@contextmanager
def serving(name: str, **options):
    server = RewardServer(name, **options).start()
    try:
        yield server
    finally:
        server.close()


def score(name: str, samples: list[RewardSample], **kwargs):
    """Score samples through a `RewardWorker`, as the agent loop does."""
    return asyncio.run(score_all(RewardWorker(name, max_batch_size=16, max_wait_ms=20, kwargs=kwargs), samples))


def rendered_samples(count: int = 6) -> list[RewardSample]:
    rng = np.random.default_rng(1)
    scenes = [shapes.sample_scene(rng, split="train") for _ in range(count)]
    return [RewardSample(torch.from_numpy(shapes.render(s, size=32)).permute(2, 0, 1).float() / 255, shapes.prompt_for(s),
                         {"uid": f"u{i}", "value": np.float32(i)}) for i, s in enumerate(scenes)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_round_trip_equals_the_local_reward():
    samples = rendered_samples()
    for name, kwargs in (("shapes", {}), ("jpeg_compressibility", {"scale_kb": 2.0})):
        with serving(name, kwargs=kwargs) as server:
            remote = score("remote", samples, url=server.url, batch_size=4)
        local = score(name, samples, **kwargs)
        assert [r.score for r in remote] == [r.score for r in local]
        assert [r.extra_info for r in remote] == [r.extra_info for r in local]
        assert all(r.extra_info["reward_error"] is None for r in remote)


def test_one_call_is_chunked_and_scores_come_back_in_order():
    samples = [RewardSample(torch.rand(3, 8, 8), f"p{i}", {"value": i}) for i in range(7)]
    fn = None
    requests = []  # rows per HTTP request, as the server received them
    with serving("test_remote_value", max_wait_ms=0) as server:
        score_request = server.score
        server.score = lambda rows: requests.append(len(rows)) or score_request(rows)
        fn = build_reward("remote", {"url": server.url, "batch_size": 3})
        scores, extra = asyncio.run(fn(torch.stack([s.image for s in samples]), [s.prompt for s in samples],
                                       [s.metadata for s in samples]))
    assert scores == [float(i) for i in range(7)] and [e["prompt"] for e in extra] == [f"p{i}" for i in range(7)]
    assert sorted(requests) == [1, 3, 3]  # concurrent requests may still share one batch on the server


def test_concurrent_requests_share_the_servers_batches():
    images = torch.rand(1, 3, 8, 8)
    with serving("test_remote_value", max_wait_ms=200) as server:
        fn = build_reward("remote", {"url": server.url})
        SEEN_BATCHES.clear()

        async def four_requests():
            return await asyncio.gather(*(fn(images, [f"p{i}"], [{"value": i}]) for i in range(4)))

        answers = asyncio.run(four_requests())
    assert [a[0] for a in answers] == [[0.0], [1.0], [2.0], [3.0]]
    assert sum(SEEN_BATCHES) == 4 and max(SEEN_BATCHES) > 1  # requests met in one reward call


def test_a_failing_sample_fails_only_its_row_with_the_servers_message():
    samples = [RewardSample(torch.rand(3, 8, 8), p, {"value": 1}) for p in ("fine", "boom", "fine")]
    with serving("test_remote_value") as server:
        results = score("remote", samples, url=server.url)
    assert [r.score for r in results] == [1.0, None, 1.0]
    error = results[1].extra_info["reward_error"]
    assert f"reward server {server.url}/score" in error and "RuntimeError: cannot score boom" in error


def test_a_slow_server_hits_the_clients_timeout():
    RELEASE.clear()
    try:
        with serving("test_remote_slow") as server:
            fn = build_reward("remote", {"url": server.url, "timeout_s": 0.3, "max_retries": 0})
            start = time.perf_counter()
            with pytest.raises(ConnectionError) as err:
                asyncio.run(fn(torch.rand(1, 3, 8, 8), ["a"], [{}]))
            assert time.perf_counter() - start < 3
            RELEASE.set()
    finally:
        RELEASE.set()
    message = str(err.value)
    assert f"reward server {server.url}/score gave no answer after 1 attempt(s) (timeout_s=0.3 each" in message
    assert "timed out" in message


def test_a_server_that_stays_down_is_retried_with_backoff_then_named():
    url = f"http://127.0.0.1:{free_port()}"
    fn = build_reward("remote", {"url": url, "max_retries": 2, "backoff_s": 0.1, "timeout_s": 1})
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=rf"reward server {url}/score gave no answer after 3 attempt\(s\) .*"
                                              r"max_retries=2\); last error: URLError: .*Connection refused.*flowloop serve-reward"):
        asyncio.run(fn(torch.rand(1, 3, 8, 8), ["a"], [{}]))
    assert time.perf_counter() - start >= 0.1 + 0.2  # waited backoff_s, then 2 * backoff_s


def test_health_bad_requests_and_the_wire_format():
    with serving("shapes") as server:
        health = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=5).read())
        assert health == {"status": "ok", "reward": "shapes"}
        bad = urllib.request.Request(f"{server.url}/score", data=b"not safetensors", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=5)
        assert err.value.code == 400 and "not a safetensors body" in json.loads(err.value.read())["error"]
    images = torch.rand(2, 3, 4, 4)
    decoded, prompts, metadata = decode_request(encode_request(images, ["a", "b"], [{"x": np.int64(3)}, {"y": {1, 2}}]))
    assert torch.equal(decoded, (images * 255).round() / 255) and prompts == ["a", "b"]
    assert metadata == [{"x": 3}, {"y": "{1, 2}"}]  # what JSON cannot carry travels as str()


def test_bad_client_settings_fail_at_build_time():
    with pytest.raises(ValueError, match="url must start with http:// or https://"):
        build_reward("remote", {"url": "localhost:8000"})
    with pytest.raises(ValueError, match=r"needs timeout_s > 0"):
        build_reward("remote", {"url": "http://localhost:8000", "timeout_s": 0})
    with pytest.raises(ValueError, match=r"reward 'remote': bad kwargs \[\] \(missing a required argument: 'url'\)"):
        build_reward("remote", {})


def test_parse_kwargs_merges_json_and_key_values():
    assert parse_kwargs(['{"components": {"shapes": 1.0}}', "components.jpeg_compressibility=0.1", "device=cpu"]) == {
        "components": {"shapes": 1.0, "jpeg_compressibility": 0.1}, "device": "cpu"}
    with pytest.raises(ValueError, match="must be a JSON object or key=value"):
        parse_kwargs(["scale_kb"])


def test_the_serve_reward_command_hosts_a_reward():
    command = [sys.executable, "-m", "flowloop.cli", "serve-reward", "jpeg_incompressibility", "--port", "0",
               "--kwargs", "scale_kb=2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving reward 'jpeg_incompressibility' at http://127.0.0.1:"), process.stderr.read()
        url = line.split(" at ")[1].split()[0]
        images = torch.rand(2, 3, 16, 16)
        fn = build_reward("remote", {"url": url})
        expected = build_reward("jpeg_incompressibility", {"scale_kb": 2})(images, ["a", "b"], [{}, {}])
        assert asyncio.run(fn(images, ["a", "b"], [{}, {}])) == expected
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_serve_reward_command_rejects_an_unknown_reward(capsys):
    from flowloop.cli import main

    assert main(["serve-reward", "pickscore_v9", "--port", "0"]) == 2
    assert "unknown reward 'pickscore_v9'" in capsys.readouterr().err

"""`RewardServer`: hosts any reward over HTTP for the ``remote`` reward (`flowloop serve-reward`).

    flowloop serve-reward jpeg_compressibility --port 8000 --kwargs scale_kb=100

    GET  /health  200 {"status": "ok", "reward": NAME}
    POST /score   body and answer: see `flowloop.reward.remote`; 400 {"error"} for a body it
                  cannot read, 500 {"error"} for a server bug

Each request's samples go to one `RewardWorker` (the trainer's own class) on an event loop in
a background thread, so concurrent requests share micro-batches (``max_batch_size``,
``max_wait_ms``), a reward model is never called from two threads at once, and a failing
sample fails only itself (its error comes back in ``errors``). The HTTP side is the standard
library's threading server: one thread per connection, which only waits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from omegaconf import OmegaConf

from flowloop.reward.remote import decode_request, to_json
from flowloop.reward.worker import ERROR_KEY, RewardResult, RewardSample, RewardWorker

logger = logging.getLogger(__name__)


class RewardServer(ThreadingHTTPServer):
    """``server = RewardServer("shapes", port=8000); server.serve_forever()`` (or ``.start()`` for
    a background thread); ``server.close()`` stops it. A bad reward name or kwarg, or a port
    that cannot be bound, is a ValueError here."""

    daemon_threads = True

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 max_batch_size: int = 64, max_wait_ms: float = 5.0):
        self.worker = RewardWorker(name, max_batch_size, max_wait_ms, kwargs)
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="reward-loop", daemon=True)
        self._loop_thread.start()
        self._serve_thread: threading.Thread | None = None
        try:
            super().__init__((host, port), _Handler)
        except OSError as err:  # port taken, unknown host
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise ValueError(f"cannot serve on {host}:{port}: {err}") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RewardServer:
        """Serve from a daemon thread (tests, notebooks); returns self."""
        self._serve_thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="reward-http", daemon=True)
        self._serve_thread.start()
        return self

    def score(self, samples: list[RewardSample]) -> list[RewardResult]:
        """Score samples on the worker's event loop; blocks the calling (request) thread."""

        async def score_all():
            return await asyncio.gather(*(self.worker.compute_score(sample) for sample in samples))

        return asyncio.run_coroutine_threadsafe(score_all(), self.loop).result()

    def close(self) -> None:
        if self._serve_thread is not None:
            self.shutdown()
            self._serve_thread = None
        self.server_close()
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.worker.stop(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(timeout=10)

    def handle_error(self, request, client_address) -> None:
        # A client that timed out and left makes the answer's write fail: worth a line, not a traceback.
        logger.warning("reward server: request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.worker.name})
        else:
            self._reply(404, {"error": f"unknown path {self.path!r}: GET /health or POST /score"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._reply(404, {"error": f"unknown path {self.path!r}: GET /health or POST /score"})
            return
        try:
            images, prompts, metadata = decode_request(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as err:
            self._reply(400, {"error": str(err)})
            return
        try:
            results = self.server.score([RewardSample(image, p, m) for image, p, m in zip(images, prompts, metadata)])
        except Exception as err:  # the worker turns reward failures into rows; this is a bug
            logger.exception("reward server failed")
            self._reply(500, {"error": f"{type(err).__name__}: {err}"})
            return
        self._reply(200, {
            "scores": [r.score for r in results],
            "extra_info": [{k: v for k, v in r.extra_info.items() if k != ERROR_KEY} for r in results],
            "errors": [r.extra_info[ERROR_KEY] for r in results],
        })

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload, default=to_json).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


def parse_kwargs(items: list[str]) -> dict[str, Any]:
    """``--kwargs`` values, merged in order: a JSON object, or ``key=value`` with dotted keys and
    YAML values as in config overrides (``scale_kb=100``, ``components.shapes=1.0``)."""
    merged = OmegaConf.create({})
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                value = json.loads(item)
            except json.JSONDecodeError as err:
                raise ValueError(f"--kwargs {item!r} is not a JSON object: {err}") from None
            if not isinstance(value, dict):
                raise ValueError(f"--kwargs {item!r} is not a JSON object")
            merged = OmegaConf.merge(merged, value)
        elif "=" in item:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        else:
            raise ValueError(f"--kwargs {item!r} must be a JSON object or key=value")
    return OmegaConf.to_container(merged)

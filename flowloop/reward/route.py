"""``by_data_source``: each row scored by the reward its ``data_source`` column names (verl's routing).

verl datasets tag every row with a ``data_source`` (``openai/gsm8k``, ``ocr``...); one run can mix
several, each judged its own way. Configure the mapping in ``reward.kwargs``:

    rollout:
      reward:
        name: by_data_source
        kwargs:
          routes:
            geneval: shapes                                  # a reward name
            ocr: {reward: remote, kwargs: {url: "http://10.0.0.2:8000"}}
          default: jpeg_compressibility                      # other sources; null: an error

Rows are split by source, each part scored by its reward (concurrently, sync ones in threads),
and put back in order. A row without a ``data_source`` takes the default. A source with no route
and no default fails its rows, naming the source and the routes there are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from flowloop.reward.registry import RewardFn, build_reward, is_async, register_reward
from flowloop.reward.worker import in_daemon_thread

SOURCE_KEY = "data_source"


def _build(source: str, spec: Any) -> RewardFn:
    if isinstance(spec, str):
        return build_reward(spec)
    if isinstance(spec, Mapping) and set(spec) <= {"reward", "kwargs"} and isinstance(spec.get("reward"), str):
        return build_reward(spec["reward"], spec.get("kwargs"))
    raise ValueError(f"reward 'by_data_source': routes[{source!r}] must be a reward name or {{reward, kwargs}}, got {spec!r}")


@register_reward("by_data_source", factory=True)
def by_data_source(routes: Mapping[str, Any], default: Any = None) -> RewardFn:
    """The async batched function routing each row by ``metadata[i]["data_source"]``."""
    if not isinstance(routes, Mapping) or not routes:
        raise ValueError("reward 'by_data_source': routes must map at least one data_source to a reward, "
                         "e.g. {routes: {geneval: shapes}}")
    built = {str(source): _build(str(source), spec) for source, spec in routes.items()}
    fallback = None if default is None else _build("default", default)

    async def score(images, prompts, metadata):
        # 1. Rows by source (order kept within each).
        groups: dict[str | None, list[int]] = {}
        for i, meta in enumerate(metadata):
            source = meta.get(SOURCE_KEY)
            groups.setdefault(source if source in built else None, []).append(i)
        if None in groups and fallback is None:
            missing = sorted({str(metadata[i].get(SOURCE_KEY)) for i in groups[None]})
            raise ValueError(f"reward 'by_data_source': no route for data_source {missing}; routes: {sorted(built)}; "
                             "add them or set kwargs.default")

        # 2. Each source's rows scored by its reward, concurrently.
        async def one(source, rows):
            fn = built[source] if source is not None else fallback
            args = (images[rows], [prompts[i] for i in rows], [metadata[i] for i in rows])
            return await fn(*args) if is_async(fn) else await in_daemon_thread(fn, *args)

        parts = await asyncio.gather(*(one(source, rows) for source, rows in groups.items()))
        # 3. Back in the batch's order.
        scores, infos = [None] * len(prompts), [None] * len(prompts)
        for rows, (part_scores, part_infos) in zip(groups.values(), parts):
            if len(part_scores) != len(rows) or len(part_infos) != len(rows):
                raise ValueError(f"reward 'by_data_source': a route returned {len(part_scores)} scores for {len(rows)} rows")
            for i, s, info in zip(rows, part_scores, part_infos):
                scores[i], infos[i] = s, info
        return scores, infos

    return score

"""Ray's Prometheus endpoints polled while an agent benchmark level runs (`bench/agent_http.py`).

A replica's gauges reach the endpoint late (the app's `metrics_interval_s` plus Ray's report
interval), so every scrape is stamped with the time it was sent and a level's summary is read over
a window the caller shifts by that lag.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "ray_vllm_num_requests_running"
# Labels Ray adds to every series of a node and session: they name no replica, role or state.
_RAY_LABELS = frozenset({"model_name", "Component", "NodeAddress", "SessionName", "Version"})


class MetricsScraper:
    """Polls Ray's Prometheus endpoints while a level runs, keeping the served model's running-requests
    gauge and `ray_hisparse_*` series, each scrape stamped with the time it was sent."""

    def __init__(self, urls: Sequence[str], model: str, interval_s: float) -> None:
        self.urls, self.model, self.interval_s = list(urls), model, interval_s
        self.scrapes: list[tuple[float, list[tuple[str, float]]]] = []  # (time, [(series, value)])
        self.failures = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Scrapes every `interval_s` until `stop` is set, then once more."""
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                await self._scrape(http)
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    continue
                await self._scrape(http)
                return

    async def _scrape(self, http: httpx.AsyncClient) -> None:
        sent = time.perf_counter()
        try:
            texts = [(await http.get(url)).text for url in self.urls]
        except httpx.HTTPError:
            self.failures += 1
            return
        self.scrapes.append((sent, await asyncio.to_thread(self._samples, texts)))

    def _samples(self, texts: list[str]) -> list[tuple[str, float]]:
        """(series, value) of the model's wanted samples; Ray's own labels dropped from the series name."""
        # Only the wanted lines are parsed: a node exports thousands of other series.
        lines = "\n".join(line for text in texts for line in text.splitlines()
                          if line.startswith((RUNNING + "{", "ray_hisparse_")) and "_bucket{" not in line)
        found = []
        for family in text_string_to_metric_families(lines):
            for s in family.samples:
                if s.labels.get("model_name") == self.model:
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                                      if k not in _RAY_LABELS and not k.startswith("otel_"))
                    found.append((f"{s.name}{{{labels}}}", s.value))
        return found

    def summary(self, start: float, end: float) -> dict[str, Any]:
        """Mean running requests and each hisparse series' first and last value over scrapes sent in [start, end]."""
        window = [samples for sent, samples in self.scrapes if start <= sent <= end]
        per_scrape = [[v for name, v in samples if name.startswith(RUNNING + "{")] for samples in window]
        running = [sum(values) for values in per_scrape if values]  # a scrape before the first export says nothing
        series: dict[str, dict[str, float]] = {}
        for samples in window:
            for name, value in samples:
                if name.startswith("ray_hisparse_"):
                    series.setdefault(name, {"first": value})["last"] = value
        return {"mean_running": statistics.fmean(running) if running else math.nan, "metric_scrapes": len(running),
                "metric_failures": self.failures, "hisparse_series": json.dumps(series)}

"""Replica metrics through `ray.util.metrics`, exported at Ray's metrics endpoint.

Names follow vLLM's as Ray's LLM dashboard reads them (Ray prefixes `ray_`,
counters gain `_total`), labelled `model_name`; Ray adds `WorkerId`, which the
dashboard joins to deployment and replica. Our own `hisparse_*` figures carry a
`role` label (prefill or decode): GPU and host page use, requests per residency
state, hot-buffer hits and misses, rows and bytes loaded from host, mirroring,
preemptions, swaps and the prefill/decode transfer; speculative decoding's drafts and
accepted tokens under vLLM's `spec_decode` names, and its verifying steps launched before the one before
was read. One `ReplicaMetrics` per replica: gauges are refreshed from the engine's stats by the replica's
periodic task, counters the engine keeps as running totals advance by their deltas, and per-request figures
are recorded when a request ends.
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
_TOKENS = [1, 8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 1048576]

# Engine stats that are running totals -> the counter each advances (vllm_* without the role label).
_TOTALS = {
    "prefix_cache_queried_tokens": ("vllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("vllm_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "preemptions": ("hisparse_preemptions", "Requests preempted (recomputed later)."),
    "swaps": ("hisparse_swaps", "Requests swapped out whole (offload policy)."),
    "prefix_cache_evictions": ("hisparse_prefix_cache_evictions", "Cached GPU pages evicted."),
    "hot_hits": ("hisparse_hot_hits", "Selected rows of non-resident pages found in the hot buffer."),
    "hot_misses": ("hisparse_hot_misses", "Selected rows loaded from host (one row run per miss)."),
    "hot_unresolved": ("hisparse_hot_unresolved", "Selected host-only rows that found no hot slot (must stay 0)."),
    "rows_copied_h2d": ("hisparse_miss_rows", "Row runs copied host to device."),
    "bytes_h2d": ("hisparse_h2d_bytes", "Bytes copied host to device for misses."),
    "pages_mirrored": ("hisparse_pages_mirrored", "Pages mirrored to the host pool."),
    "pages_demoted": ("hisparse_pages_demoted", "GPU pages freed by demotion (host copy kept)."),
    "pages_promoted": ("hisparse_pages_promoted", "Pages moved back to the GPU."),
    "mirror_skipped_host_full": ("hisparse_mirror_skipped_host_full", "Mirrors skipped: host pool full."),
    "spec_decode_num_drafts": ("vllm_spec_decode_num_drafts", "Requests' verifications of MTP drafts."),
    "spec_decode_num_draft_tokens": ("vllm_spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("vllm_spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_num_continued_steps": (
        "hisparse_spec_decode_continued_steps", "Verifying steps launched before the step they continue was read."),
}
# Engine stats that are levels -> the gauge each sets.
_LEVELS = {
    "running": ("vllm_num_requests_running", "Requests in the running batch."),
    "waiting": ("vllm_num_requests_waiting", "Requests waiting for admission."),
    "swapped": ("vllm_num_requests_swapped", "Requests swapped out to host."),
    "pages_in_use": ("hisparse_pages_in_use", "GPU pages held by requests."),
    "pages_free": ("hisparse_pages_free", "GPU pages on the free list."),
    "pages_cached": ("hisparse_pages_cached", "GPU pages kept only by the prefix cache."),
    "host_pages": ("hisparse_host_pages", "Pages of the pinned host pool."),
    "mirror_backlog": ("hisparse_mirror_backlog", "Completed pages whose host copy is still in flight."),
    "host_pages_in_use": ("hisparse_host_pages_in_use", "Host pages held by requests."),
    "host_pages_cached": ("hisparse_host_pages_cached", "Host pages kept only by the host prefix cache."),
    "spec_decode_mean_acceptance_length": (
        "hisparse_spec_decode_mean_acceptance_length", "Tokens a verifying step yields per request, on average."),
}
RESIDENCY_STATES = ("full", "mixed", "none", "waiting", "swapped")


class ReplicaMetrics:
    """The metrics of one prefill or decode replica."""

    def __init__(self, model_name: str, role: str) -> None:
        self._tags = {"model_name": model_name}
        self._role_tags = {"model_name": model_name, "role": role}
        keys, role_keys = ("model_name",), ("model_name", "role")

        def tags_of(name: str) -> tuple[str, ...]:
            return role_keys if name.startswith("hisparse_") else keys

        self._gauges = {stat: Gauge(name, doc, tags_of(name)) for stat, (name, doc) in _LEVELS.items()}
        self._usage = Gauge("vllm_kv_cache_usage_perc", "Fraction of GPU KV pages held by requests.", keys)
        self._states = Gauge("hisparse_requests", "Requests per residency state.", (*role_keys, "state"))
        self._counters = {stat: Counter(name, doc, tags_of(name)) for stat, (name, doc) in _TOTALS.items()}
        self._last_totals: dict[str, float] = {}
        self._prompt_tokens = Counter("vllm_prompt_tokens", "Prompt tokens of finished requests.", keys)
        self._generation_tokens = Counter("vllm_generation_tokens", "Generated tokens.", keys)
        self._success = Counter(
            "vllm_request_success", "Finished requests by finish reason.", ("model_name", "finished_reason")
        )
        self._ttft = Histogram("vllm_time_to_first_token_seconds", "Time to first token.", _SECONDS, keys)
        self._tpot = Histogram(
            "vllm_request_time_per_output_token_seconds", "Mean time per output token.", _SECONDS, keys
        )
        self._e2e = Histogram("vllm_e2e_request_latency_seconds", "Request latency.", _SECONDS, keys)
        self._prompt_len = Histogram("vllm_request_prompt_tokens", "Prompt length.", _TOKENS, keys)
        self._gen_len = Histogram("vllm_request_generation_tokens", "Output length.", _TOKENS, keys)
        self._transfers = Counter(
            "hisparse_kv_transfers", "Remote prefills by outcome (imported, fallback).", (*role_keys, "outcome")
        )
        self._transfer_tokens = Counter("hisparse_kv_transfer_tokens", "Prompt tokens moved as KV.", role_keys)
        self._transfer_bytes = Counter("hisparse_kv_transfer_bytes", "KV bytes moved.", role_keys)
        self._transfer_seconds = Histogram(
            "hisparse_kv_transfer_seconds", "Remote prefill plus import time.", _SECONDS, role_keys
        )

    def _tags_for(self, name: str) -> dict[str, str]:
        return self._role_tags if name.startswith("hisparse_") else self._tags

    def update_engine(self, stats: dict[str, Any]) -> None:
        """Refreshes gauges and advances running totals from the replica's stats (absent figures are skipped)."""
        for stat, gauge in self._gauges.items():
            if stat in stats:
                gauge.set(stats[stat], self._tags_for(_LEVELS[stat][0]))
        self._usage.set(stats["pages_in_use"] / max(stats["num_pages"], 1), self._tags)
        for state, count in stats.get("requests_now", {}).items():
            self._states.set(count, {**self._role_tags, "state": state})
        for stat, counter in self._counters.items():
            delta = stats.get(stat, 0) - self._last_totals.get(stat, 0)
            self._last_totals[stat] = stats.get(stat, 0)
            if delta > 0:
                counter.inc(delta, self._tags_for(_TOTALS[stat][0]))

    def request_finished(
        self, num_prompt_tokens: int, num_output_tokens: int, ttft_s: float | None, e2e_s: float, reason: str
    ) -> None:
        """Records one request that ended (finished, refused mid-way or aborted)."""
        if num_prompt_tokens:
            self._prompt_tokens.inc(num_prompt_tokens, self._tags)
            self._prompt_len.observe(num_prompt_tokens, self._tags)
        if num_output_tokens:
            self._generation_tokens.inc(num_output_tokens, self._tags)
        self._gen_len.observe(num_output_tokens, self._tags)
        self._success.inc(1, {**self._tags, "finished_reason": reason})
        self._e2e.observe(e2e_s, self._tags)
        if ttft_s is not None:
            self._ttft.observe(ttft_s, self._tags)
            if num_output_tokens > 1:
                self._tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1), self._tags)

    def transfer(self, outcome: str, num_tokens: int = 0, num_bytes: int = 0, seconds: float | None = None) -> None:
        """Records one remote prefill: `imported` (KV landed) or `fallback` (prefilled locally instead)."""
        self._transfers.inc(1, {**self._role_tags, "outcome": outcome})
        if num_tokens:
            self._transfer_tokens.inc(num_tokens, self._role_tags)
        if num_bytes:
            self._transfer_bytes.inc(num_bytes, self._role_tags)
        if seconds is not None:
            self._transfer_seconds.observe(seconds, self._role_tags)

"""The agent workload (`bench/agent_trace.py`) driven through the real HTTP API, as an agent framework does.

Each concurrency level runs its conversations closed-loop over the official `openai` client
(streaming chat completions): a conversation sends its next turn as soon as the previous one
finished, and every turn repeats the conversation so far (earlier user turns plus the assistant's
actual replies) before its new user text, so the server's prefix cache meets what agents give it.
User text is English words cut to the scaled token count with the served model's own tokenizer
(the app's /tokenize and /detokenize routes), built before the level starts so no tokenizing falls
inside the timed part; texts are new for every run, label and level, so one run never finds
another's prefixes cached. `--scale` multiplies every token count; start the server with its KV
and host pools scaled by the same factor (see bench/policies.py) to keep GLM-5.3's memory pressure.

Measured per turn: TTFT (request sent to first generated text), TPOT (mean time per output token
after the first), prompt, cached-prompt and output tokens from the stream's usage (this app counts
KV imported from a prefill replica as cached too), errors. While a level runs, Ray's Prometheus
endpoint is scraped: the mean of `ray_vllm_num_requests_running` (all replicas of the model summed)
and the first and last value of every `ray_hisparse_*` series. A replica's gauge reaches the
endpoint late (the app's `metrics_interval_s`, Ray's `metrics_report_interval_ms` (10 s by
default) and the export itself): `--metrics-lag` shifts each level's metric window by that much
(the next level waits for it), and a level should last many such lags for its mean to be its own.

Per level, what vLLM's agent benchmark plots: interactivity = 1000 / mean TPOT in ms (tokens/s per
user) against throughput per GPU = (prompt tokens, cached included, + output tokens) / wall time /
GPUs, and mean running requests. The residency policy is the server's setting; `--label` names the
run, so runs against servers with different policies share one results folder
(`bench/agent_results.py`: the Parquet files, plots and table). Writes under `--out` (default
`$OUT`, else bench/out), logs to agent_http.log there, prints the table of every label there last.
Usage: python bench/agent_http.py --label hybrid --scale 1 --metrics-url http://127.0.0.1:8080/metrics
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_metrics import MetricsScraper  # noqa: E402
from bench.agent_results import LEVELS_FILE, PLOT_FILES, TURNS_FILE, format_table, write_results  # noqa: E402
from bench.agent_trace import TURNS, TurnLengths  # noqa: E402
from bench.timing import run_log  # noqa: E402

_WORDS = (
    "the agent reads a file and runs the tests then edits the function that fails because the value "
    "is wrong so it checks the error message in the log before it calls the tool again with a new "
    "argument and writes a patch for the module while the user waits for a short summary of what "
    "changed in the repository and why the build passes now after one more step of the plan"
).split()


@dataclass(frozen=True)
class RunSpec:
    """What one harness run sends and where it reads metrics."""

    base_url: str
    """The OpenAI base URL (the app's root plus /v1)."""
    api_key: str
    """Bearer key sent with every request."""
    model: str
    """The served model id; empty until asked of /v1/models."""
    label: str
    """Names the run in the results (the server's residency policy, say)."""
    lengths: TurnLengths
    """Scaled token counts of the trace."""
    turns: int
    """Turns per conversation."""
    conversations: int | None
    """Conversations per level, at least the level's concurrency; None = as many as the concurrency."""
    session_header: str
    """Header naming the conversation, so the app routes its turns to the replica holding its prefix."""
    num_gpus: float
    """GPUs the server uses: throughput is divided by it."""
    metrics_urls: tuple[str, ...]
    """Ray's Prometheus endpoint of every node."""
    metrics_interval_s: float
    """Seconds between scrapes."""
    metrics_lag_s: float
    """Seconds a replica's gauge takes to reach the endpoint: the level's window is read that much later."""
    seed: int
    """Seeds the texts: a new seed gives conversations no cache has seen."""
    timeout_s: float
    """Seconds one request may take."""


@dataclass
class TurnRecord:
    """One turn as it ran (times in seconds from the level's start or the turn's request)."""

    label: str
    concurrency: int
    conversation: int
    turn: int
    start_s: float
    new_prompt_tokens: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


# --- prompt text -------------------------------------------------------------------------------------------


def _api_root(base_url: str) -> str:
    """The server's root (where /tokenize lives) from the OpenAI base URL."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _words(rng: random.Random, n: int) -> str:
    """`n` words in sentences of 6 to 15 words: plain English text, different for every seed."""
    out: list[str] = []
    while len(out) < n:
        sentence = rng.choices(_WORDS, k=rng.randint(6, 15))
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out[:n])


async def _text_of(http: httpx.AsyncClient, spec: RunSpec, rng: random.Random, num_tokens: int) -> str:
    """Text the served tokenizer reads as about `num_tokens` tokens: words, tokenized, cut, detokenized."""
    num_words = num_tokens
    for _ in range(8):
        text = _words(rng, num_words)
        tokens = (await _post(http, spec, "/tokenize", {"model": spec.model, "prompt": text}))["tokens"]
        if len(tokens) >= num_tokens:
            cut = {"model": spec.model, "tokens": tokens[:num_tokens]}
            return (await _post(http, spec, "/detokenize", cut))["prompt"]
        num_words = math.ceil(num_words * 1.2 * num_tokens / max(len(tokens), 1)) + 4
    raise RuntimeError(f"could not build text of {num_tokens} tokens")


async def _post(http: httpx.AsyncClient, spec: RunSpec, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(_api_root(spec.base_url) + route, json=body)
    response.raise_for_status()
    return response.json()


async def conversation_texts(spec: RunSpec, concurrency: int, num_conversations: int) -> list[list[str]]:
    """The user text of every turn of every conversation of a level."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {spec.api_key}"}, timeout=spec.timeout_s) as http:
        async def one(conv: int) -> list[str]:
            rng = random.Random(f"{spec.seed}/{spec.label}/{concurrency}/{conv}")
            return [await _text_of(http, spec, rng, spec.lengths.new_prompt_tokens(t)) for t in range(spec.turns)]

        return list(await asyncio.gather(*(one(c) for c in range(num_conversations))))


# --- the closed loop ---------------------------------------------------------------------------------------


@dataclass
class _Reply:
    """What the stream of one turn brought: times of its first text and of its finish, text, usage."""

    first: float | None = None
    end: float | None = None
    num_chunks: int = 0
    usage: Any = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message the next turn repeats: the reply as the client received it."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if any(self.reasoning):
            message["reasoning_content"] = "".join(self.reasoning)
        return message


async def _stream(client: openai.AsyncOpenAI, spec: RunSpec, messages: list[dict[str, Any]], session: str) -> _Reply:
    """Sends one turn and reads its stream to the end, stamping the first text and the finish as they arrive."""
    reply = _Reply()
    stream = await client.chat.completions.create(
        model=spec.model, messages=messages, max_tokens=spec.lengths.output, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={spec.session_header: session})
    async for chunk in stream:
        now = time.perf_counter()
        reply.usage = chunk.usage or reply.usage
        for choice in chunk.choices:
            text, thought = choice.delta.content or "", getattr(choice.delta, "reasoning_content", None) or ""
            if text or thought:
                reply.first, reply.num_chunks = reply.first or now, reply.num_chunks + 1
                reply.content.append(text)
                reply.reasoning.append(thought)
            if choice.finish_reason is not None:
                reply.end = now
    return reply


async def _turn(client: openai.AsyncOpenAI, spec: RunSpec, messages: list[dict[str, Any]], session: str,
                record: TurnRecord) -> dict[str, Any] | None:
    """Streams one turn into `record`; returns the assistant message to append, None on error."""
    start = time.perf_counter()
    try:
        reply = await _stream(client, spec, messages, session)
    except (openai.APIError, httpx.HTTPError) as exc:
        record.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        return None
    usage = reply.usage
    record.output_tokens = usage.completion_tokens if usage else reply.num_chunks
    if usage:
        details = usage.prompt_tokens_details
        record.prompt_tokens, record.cached_tokens = usage.prompt_tokens, (details.cached_tokens or 0) if details else 0
    if reply.first is None or record.output_tokens == 0:
        record.error = "no output tokens"
        return None
    end = reply.end or time.perf_counter()
    record.ttft_s, record.e2e_s = reply.first - start, end - start
    if record.output_tokens > 1:
        record.tpot_s = (end - reply.first) / (record.output_tokens - 1)
    return reply.message()


async def _conversation(client: openai.AsyncOpenAI, spec: RunSpec, concurrency: int, index: int,
                        texts: list[str], gate: asyncio.Semaphore, t0: float) -> list[TurnRecord]:
    """One conversation, turn after turn; it stops at its first error (its history would be wrong)."""
    session = f"{spec.label}-{spec.seed}-c{concurrency}-{index}"
    messages: list[dict[str, Any]] = []
    records: list[TurnRecord] = []
    async with gate:
        for turn, text in enumerate(texts):
            messages.append({"role": "user", "content": text})
            record = TurnRecord(spec.label, concurrency, index, turn, time.perf_counter() - t0,
                                spec.lengths.new_prompt_tokens(turn))
            records.append(record)
            reply = await _turn(client, spec, messages, session, record)
            if reply is None:
                break
            messages.append(reply)
    return records


# --- one level -------------------------------------------------------------------------------------------------


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(spec: RunSpec, concurrency: int, records: list[TurnRecord], wall_s: float,
              metrics: dict[str, Any]) -> dict[str, Any]:
    """The level's row: what vLLM's agent benchmark reports, plus the token counts behind it."""
    ok = [r for r in records if r.error is None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    tpot_ms = 1e3 * statistics.fmean(tpots) if tpots else math.nan
    prompt, cached, output = (sum(getattr(r, name) for r in records)
                              for name in ("prompt_tokens", "cached_tokens", "output_tokens"))
    return {
        "label": spec.label, "concurrency": concurrency, "conversations": len({r.conversation for r in records}),
        "turns": spec.turns, "model": spec.model, "num_gpus": spec.num_gpus,
        "first_prompt_tokens": spec.lengths.first_prompt, "later_prompt_tokens": spec.lengths.later_prompt,
        "output_tokens_per_turn": spec.lengths.output,
        "wall_s": wall_s, "requests": len(records), "errors": len(records) - len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "ttft_p50_s": _quantile([r.ttft_s for r in ok], 0.5), "ttft_p99_s": _quantile([r.ttft_s for r in ok], 0.99),
        "tpot_mean_ms": tpot_ms, "interactivity_tok_s_user": 1e3 / tpot_ms if tpots else math.nan,
        "throughput_tok_s_gpu": (prompt + output) / wall_s / spec.num_gpus,
        "output_tok_s_gpu": output / wall_s / spec.num_gpus, **metrics,
        "seed": spec.seed, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


async def run_level(spec: RunSpec, concurrency: int) -> tuple[dict[str, Any], list[TurnRecord]]:
    """Runs one concurrency level; returns its row and its turns."""
    texts = await conversation_texts(spec, concurrency, max(spec.conversations or 0, concurrency))
    scraper = MetricsScraper(spec.metrics_urls, spec.model, spec.metrics_interval_s)
    stop = asyncio.Event()
    async with openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0,
                                  timeout=spec.timeout_s) as client:
        scraping = asyncio.create_task(scraper.run(stop))
        gate, t0 = asyncio.Semaphore(concurrency), time.perf_counter()
        done = await asyncio.gather(*(_conversation(client, spec, concurrency, i, turn_texts, gate, t0)
                                      for i, turn_texts in enumerate(texts)))
        wall_s = time.perf_counter() - t0
        await asyncio.sleep(spec.metrics_lag_s)  # the gauges of the level's last moments are still on their way
        stop.set()
        await scraping
    records = [r for conv in done for r in conv]
    lag = spec.metrics_lag_s
    return summarize(spec, concurrency, records, wall_s, scraper.summary(t0 + lag, t0 + wall_s + lag)), records


async def warm_up(spec: RunSpec) -> None:
    """One short untimed request, so one-time start-up costs (first kernel compiles, connections) fall
    outside the first level."""
    async with openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0,
                                  timeout=spec.timeout_s) as client:
        await client.chat.completions.create(model=spec.model, max_tokens=4,
                                             messages=[{"role": "user", "content": "warm up"}])


# --- command line -------------------------------------------------------------------------------------------


def gpus_of_config(path: Path) -> float:
    """GPUs a Serve config reserves for its prefill and decode replicas (at least 1: a CPU run counts one)."""
    total = 0.0
    for app in yaml.safe_load(path.read_text())["applications"]:
        for role in ("decode", "prefill"):
            section = app.get("args", {}).get(role) or {}
            total += section.get("num_replicas", 1 if role == "decode" else 0) * section.get("num_gpus", 0)
    return max(total, 1.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=None, help="Bearer key (default: $HISPARSE_API_KEY, else none)")
    parser.add_argument("--model", default=None, help="the served model id (default: the first of /v1/models)")
    parser.add_argument("--scale", type=float, default=1.0, help="factor on every token count of the trace")
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--concurrency", default="1,8,16,24,32", help="levels: conversations in flight at once")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations per level, at least its concurrency (default: the concurrency)")
    parser.add_argument("--label", default="hybrid", help="names this run (the server's residency policy, say)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs the server uses (default: from --config, else 1)")
    parser.add_argument("--config", type=Path, default=None, help="the server's Serve config, for --num-gpus")
    parser.add_argument("--session-header", default="x-session-id", help="the app's routing.session_header")
    parser.add_argument("--metrics-url", action="append", default=None,
                        help="Ray's Prometheus endpoint, once per node (default: http://127.0.0.1:8080/metrics)")
    parser.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between metric scrapes")
    parser.add_argument("--metrics-lag", type=float, default=0.0,
                        help="seconds the metrics lag the server (its gauge interval plus Ray's report interval): "
                             "each level's metrics are read over its run shifted by this much")
    parser.add_argument("--seed", type=int, default=None, help="seeds the texts (default: new every run)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request")
    return parser.parse_args(argv)


async def _served_model(base_url: str, api_key: str) -> str:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return (await client.models.list()).data[0].id


def spec_of(args: argparse.Namespace) -> RunSpec:
    api_key = args.api_key or os.environ.get("HISPARSE_API_KEY") or "none"
    num_gpus = args.num_gpus or (gpus_of_config(args.config) if args.config else 1.0)
    return RunSpec(
        base_url=args.base_url, api_key=api_key, model=args.model or "", label=args.label,
        lengths=TurnLengths.scaled(args.scale), turns=args.turns, conversations=args.conversations,
        session_header=args.session_header, num_gpus=num_gpus,
        metrics_urls=tuple(args.metrics_url or ["http://127.0.0.1:8080/metrics"]),
        metrics_interval_s=args.metrics_interval, metrics_lag_s=args.metrics_lag,
        seed=args.seed if args.seed is not None else random.getrandbits(31), timeout_s=args.timeout)


async def sweep(spec: RunSpec, levels: list[int], warm: bool,
                log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[TurnRecord]]:
    """Every level in turn, each logged as it ends."""
    if not spec.model:
        spec = replace(spec, model=await _served_model(spec.base_url, spec.api_key))
    log(f"agent_http {spec.label}: model {spec.model}, turns {spec.turns}, prompt {spec.lengths.first_prompt} + "
        f"{spec.lengths.later_prompt}/turn, output {spec.lengths.output}, GPUs {spec.num_gpus:g}, seed {spec.seed}")
    if warm:
        await warm_up(spec)
    rows: list[dict[str, Any]] = []
    turns: list[TurnRecord] = []
    for concurrency in levels:
        row, records = await run_level(spec, concurrency)
        rows.append(row)
        turns += records
        log(json.dumps({k: v for k, v in row.items() if k != "hisparse_series"}))
    return rows, turns


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    log = run_log("agent_http", out)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows, turns = asyncio.run(sweep(spec_of(args), levels, not args.no_warmup, log))
    merged = write_results(out, rows, [asdict(t) for t in turns])
    log(f"results in {out}: {LEVELS_FILE}, {TURNS_FILE}, {', '.join(PLOT_FILES)}")
    log(format_table(merged))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

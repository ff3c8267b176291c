"""The real application on a local Ray cluster, driven over HTTP with the official `openai` client.

One cluster and three applications for the whole module: `hisparse` is configs/tiny.yaml
(one prefill and one decode replica) with the test's tiny model; `tight` is the same
model colocated with a one-request queue and an API key, for overload, authentication
and drain; `pressure` has a 24-page KV pool, so imported KV must land in the host pool.
Tests share them; the one that deletes an application runs last (replica kills are in
tests/test_app_hardening.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import serve

from app.main import build_app
from tests.serve_helpers import ROOT, free_port, replica_idle, replica_stats, tiny_args, wait_for

PORT = free_port()
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "glm-tiny"
TIGHT_KEY = "test-secret"
LONG_USER_TURN = "the weather in the city of Paris " * 70  # about 800 prompt tokens: one indexer page moves


def _tight_args(model_dir: Path) -> dict[str, Any]:
    args = tiny_args(model_dir)
    args["model_id"] = "glm-tiny-tight"
    args["prefill"]["num_replicas"] = 0
    # a drain of the deletion test's 400-token stream: about 10 s on an idle 2-core machine, 20 s under load
    args["decode"].update(max_ongoing_requests=1, max_queued_requests=1, num_cpus=0.25, graceful_shutdown_timeout_s=60)
    args["api"]["api_key"] = TIGHT_KEY
    return args


def _pressure_args(model_dir: Path) -> dict[str, Any]:
    args = tiny_args(model_dir)
    args["model_id"] = "glm-tiny-pressure"
    args["engine"]["num_gpu_pages"] = 24  # one long request holds most of it
    args["engine"]["num_speculative_tokens"] = 2  # prefill and decode replicas draft (MTP rows in their pages)
    args["decode"]["num_cpus"] = args["prefill"]["num_cpus"] = 0.25
    return args


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
             _system_config={"metrics_report_interval_ms": 1000})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(tiny_args(tiny_dir)), name="hisparse", route_prefix="/")
    serve.run(build_app(_tight_args(tiny_dir)), name="tight", route_prefix="/tight")
    serve.run(build_app(_pressure_args(tiny_dir)), name="pressure", route_prefix="/pressure")
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def client(cluster: None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def test_models_health_and_tokenizer_routes(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(f"{BASE}/health").status_code == 200
    tokens = httpx.post(f"{BASE}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 2048
    assert httpx.post(f"{BASE}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello world"}
    chat = httpx.post(f"{BASE}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][-1] == tokens_of("<|assistant|>\n")[-1]
    # the count an agent budgets with is the prompt chat sends, template arguments included
    counts = []
    for kwargs in ({}, {"enable_thinking": False}):
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
        counted = httpx.post(f"{BASE}/tokenize", json=body).json()["count"]
        reply = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=1,
                                               extra_body={"chat_template_kwargs": kwargs})
        assert counted == reply.usage.prompt_tokens
        counts.append(counted)
    assert counts[0] != counts[1]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for choice in ("auto", "none"):  # 'none' renders no tools, in chat and in its count alike
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
        counted = httpx.post(f"{BASE}/tokenize", json=body).json()["count"]
        reply = client.chat.completions.create(model=MODEL, max_tokens=1, **body)
        assert counted == reply.usage.prompt_tokens
        assert (counted == counts[0]) == (choice == "none")
    refused = httpx.post(f"{BASE}/tokenize", json={"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def tokens_of(text: str) -> list[int]:
    return httpx.post(f"{BASE}/tokenize", json={"prompt": text}).json()["tokens"]


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(**_chat("Hello there"), max_tokens=8, temperature=0, seed=1)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 3
    again = client.chat.completions.create(**_chat("Hello there"), max_tokens=8, temperature=0, seed=1)
    assert again.choices[0].message.content == choice.message.content


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = _chat("Tell me a story", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_completions(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens <= 6
    by_ids = client.completions.create(model=MODEL, prompt=tokens_of("Once upon a time"), max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == done.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def test_special_tokens_are_skipped_unless_asked_for(client: openai.OpenAI) -> None:
    """Role headers the model emits stay out of the text, as vLLM's `skip_special_tokens` (true by default)."""
    sampled = dict(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=3)
    texts = [client.completions.create(**sampled, extra_body={"ignore_eos": True, **flag}).choices[0].text
             for flag in ({}, {"skip_special_tokens": False})]
    headers = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "[gMASK]", "<sop>")
    assert not any(h in texts[0] for h in headers) and any(h in texts[1] for h in headers)


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = httpx.post(f"{BASE}/tokenize", json={"messages": messages, "tools": tools}).json()
    assert "<tools>" in httpx.post(f"{BASE}/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12,
                                           parallel_tool_calls=False)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The agent runs the tool and sends the call and its result back, as OpenAI clients do.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12, stream=True)
    assert [c.choices[0].finish_reason for c in second if c.choices][-1] in ("stop", "length", "tool_calls")
    rendered = httpx.post(f"{BASE}/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
    text = httpx.post(f"{BASE}/detokenize", json={"tokens": rendered}).json()["prompt"]
    assert "<tool_call>get_weather" in text and "<tool_response>" in text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        ('{"model": "glm-tiny"}', 400, "messages"),
        ('{"model": "glm-tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "top_p"),
        ('{"model": "glm-tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
        ('{"model": "glm-tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
        ('{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(cluster: None, body: str, status: int, param: str | None) -> None:
    response = httpx.post(f"{BASE}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_errors_through_the_client_and_serving_after(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="admits at most"):
        client.chat.completions.create(**_chat("word " * 3000), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="token ids must be") as refused:  # by the decode engine
        client.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=4)
    assert refused.value.param == "prompt"
    assert client.chat.completions.create(**_chat("still there?"), max_tokens=4).choices[0].message is not None


def test_prefill_decode_path_is_taken(client: openai.OpenAI) -> None:
    before_p, before_d = replica_stats("PrefillServer", "hisparse"), replica_stats("DecodeServer", "hisparse")
    reply = client.chat.completions.create(**_chat("Tell me about " + LONG_USER_TURN), max_tokens=4)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 576
    after_p, after_d = replica_stats("PrefillServer", "hisparse"), replica_stats("DecodeServer", "hisparse")
    assert after_p.get("prefills", 0) == before_p.get("prefills", 0) + 1
    assert after_p["prefill_computed_tokens"] - before_p.get("prefill_computed_tokens", 0) >= 576
    assert after_d["remote_prefills"] == before_d.get("remote_prefills", 0) + 1
    assert after_d["imported_tokens"] - before_d.get("imported_tokens", 0) == reply.usage.prompt_tokens_details.cached_tokens
    # The next turn of the conversation finds its prefix on the decode replica: nothing moves again.
    follow = client.chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Tell me about " + LONG_USER_TURN},
                                             {"role": "assistant", "content": "Sure."},
                                             {"role": "user", "content": "More?"}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= 576
    assert replica_stats("DecodeServer", "hisparse")["remote_prefills"] == after_d["remote_prefills"]


def test_disconnect_mid_stream_frees_pages(cluster: None) -> None:
    aborted = replica_stats("DecodeServer", "hisparse").get("finished_abort", 0)
    body = _chat("Keep talking", max_tokens=1500, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
    wait_for(lambda: replica_stats("DecodeServer", "hisparse").get("finished_abort", 0) == aborted + 1, 20)
    wait_for(lambda: replica_idle("DecodeServer", "hisparse"), 10)


def test_a_client_gone_before_its_first_token_is_counted(cluster: None) -> None:
    """A client that leaves while its new long prompt is prefilled remotely ends an aborted request, counted once
    like one that leaves mid-stream."""
    aborted = replica_stats("DecodeServer", "hisparse").get("finished_abort", 0)
    prompt = " ".join(f"the weather in Lyon on day {i}." for i in range(60))  # about 1,000 tokens, none cached
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{BASE}/v1/chat/completions", json=_chat(prompt, max_tokens=1500, ignore_eos=True), timeout=0.2)
    wait_for(lambda: replica_stats("DecodeServer", "hisparse").get("finished_abort", 0) == aborted + 1, 30)
    wait_for(lambda: replica_idle("DecodeServer", "hisparse") and replica_idle("PrefillServer", "hisparse"))


def test_burst_of_streams_completes_and_pools_return_to_baseline(cluster: None) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        prompt = f"Request {i}: " + ("tell me more about the city " * (30 if i % 3 else 60))
        stream = await client.chat.completions.create(**_chat(prompt), max_tokens=20, stream=True,
                                                      extra_body={"ignore_eos": True})
        reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
        return reasons[-1]

    async def burst() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    assert asyncio.run(burst()) == ["length"] * 12
    wait_for(lambda: replica_idle("DecodeServer", "hisparse") and replica_idle("PrefillServer", "hisparse"))
    stats = replica_stats("DecodeServer", "hisparse")
    assert stats["pages_free"] + stats["pages_cached"] == stats["num_pages"]


def test_overload_gets_503_and_api_key_is_enforced(cluster: None) -> None:
    url, auth = f"{BASE}/tight/v1/chat/completions", {"Authorization": f"Bearer {TIGHT_KEY}"}
    body = {**_chat("Go on"), "model": "glm-tiny-tight", "max_tokens": 200, "ignore_eos": True}
    missing = httpx.post(url, json=body)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(url, json=body, headers=auth) for _ in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1 and set(statuses) <= {200, 503}
    assert next(r for r in responses if r.status_code == 503).json()["error"]["code"] == "overloaded"
    small = {**body, "max_tokens": 2}
    assert httpx.post(url, json=small, headers=auth).status_code == 200
    wait_for(lambda: replica_idle("DecodeServer", "tight"))


def test_kv_lands_in_the_host_pool_when_the_gpu_pool_is_short(cluster: None) -> None:
    url = f"{BASE}/pressure/v1/chat/completions"
    # About 900 prompt tokens plus 300 output tokens: 17 pages at once, 22 at the end.
    busy = {**_chat("Busy: " + LONG_USER_TURN + LONG_USER_TURN[:330]), "model": "glm-tiny-pressure",
            "max_tokens": 300, "stream": True, "ignore_eos": True}
    before = replica_stats("DecodeServer", "pressure")
    with httpx.stream("POST", url, json=busy, timeout=60) as background:
        lines = background.iter_lines()
        assert next(lines).startswith("data: ")  # its prompt is computed: it holds most of the pool now
        body = {**_chat("Tell me about " + LONG_USER_TURN), "model": "glm-tiny-pressure", "max_tokens": 4}
        reply = httpx.post(url, json=body, timeout=60).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576
        after = replica_stats("DecodeServer", "pressure")
        assert after.get("imported_tokens_host", 0) - before.get("imported_tokens_host", 0) >= 576
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    wait_for(lambda: replica_idle("DecodeServer", "pressure"))


def test_metrics_reach_the_export_endpoint(cluster: None) -> None:
    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = ["ray_vllm_num_requests_running{", "ray_vllm_time_to_first_token_seconds_bucket{",
              "ray_vllm_generation_tokens_total{", "ray_vllm_prefix_cache_hits_total{",
              "ray_hisparse_pages_in_use{", "ray_hisparse_kv_transfers_total{", "ray_hisparse_requests{"]

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if 'model_name="glm-tiny"' in line and "WorkerId=" in line]
        return all(any(line.startswith(name) for line in lines) for name in wanted)

    wait_for(exported, 60)

    def drafted() -> bool:  # the pressure app decodes with MTP drafts (test_kv_lands_in_the_host_pool... ran it)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return any(line.startswith("ray_vllm_spec_decode_num_draft_tokens_total{")
                   and 'model_name="glm-tiny-pressure"' in line and not line.endswith(" 0.0")
                   for line in text.splitlines())

    wait_for(drafted, 60)


def test_deleting_an_application_drains_its_streams(cluster: None) -> None:
    body = {**_chat("Go on"), "model": "glm-tiny-tight", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TIGHT_KEY}"}
    with httpx.stream("POST", f"{BASE}/tight/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        serve.delete("tight", _blocking=False)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

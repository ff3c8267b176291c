"""Command line: `python -m engine {make-tiny,generate,chat}`.

`generate` submits every request at once so they batch, and with `--json`
prints one JSON line per request in input order followed by `{"stats": ...}`.
A request the engine refuses gets an `{"error": ...}` line in its place; the
others still run. `chat` is an interactive conversation through the chat
template. Flags are kept stable: acceptance checks drive the engine through them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import InvalidRequestError, SamplingParams
from engine.tiny import make_tiny
from residency.config import POLICIES, HiSparseConfig

logger = logging.getLogger("engine")

DEFAULT_TINY_DIR = Path("models/tiny")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_TINY_DIR, help="local Hugging Face model directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-dtype", choices=["auto", "float32", "bf16", "fp8"], default="auto")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-gpu-pages", type=int, default=None, help="KV pool size in pages")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--random-weights", action="store_true", help="seeded random init instead of loading weights")
    p.add_argument("--quantization", choices=["auto", "fp8", "none"], default="auto",
                   help="linear weights: auto keeps an FP8 checkpoint FP8 in bfloat16 mode; fp8 forces FP8")
    p.add_argument("--policy", choices=list(POLICIES), default="off", help="what frees KV pages under pressure")
    p.add_argument("--host-pool-gib", type=float, default=0.0, help="host tier for hybrid / offload")
    p.add_argument("--hot-rows", type=int, default=None, help="hot slots per demoted request (default 2 x top-K)")
    p.add_argument("--offload-pool-gib", type=float, default=0.0,
                   help="host budget for indexer pages of parked requests (hybrid)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is split over")
    p.add_argument("--executor", choices=["mp", "ray"], default="mp",
                   help="how ranks run when --tensor-parallel-size > 1: processes or Ray actors")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly: no persistent buffers, no CUDA graphs")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (no host/device overlap)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="draft tokens a step from the model's MTP layer (speculative decoding); 0 = off")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model == DEFAULT_TINY_DIR and not (args.model / "config.json").is_file():
        logger.info("creating the tiny model in %s", args.model)
        make_tiny(args.model)
    return EngineConfig(
        model=str(args.model),
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        device=args.device,
        num_gpu_pages=args.num_gpu_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_cache=not args.no_prefix_cache,
        seed=args.seed if args.seed is not None else 0,
        random_weights=args.random_weights,
        quantization=args.quantization,
        hisparse=HiSparseConfig(policy=args.policy, host_pool_gib=args.host_pool_gib, hot_rows=args.hot_rows,
                                offload_pool_gib=args.offload_pool_gib),
        tensor_parallel_size=args.tensor_parallel_size,
        executor=args.executor,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        num_speculative_tokens=args.num_speculative_tokens,
    )


def _read_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.requests is not None:
        lines = [ln for ln in Path(args.requests).read_text().splitlines() if ln.strip()]
        return [json.loads(ln) for ln in lines]
    if args.prompt_token_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise InvalidRequestError(f"--prompt-token-ids must be comma-separated integers: {exc}") from exc
        return [{"prompt_token_ids": ids}]
    return [{"prompt": args.prompt}]


def _submit(engine: LLMEngine, i: int, spec: dict[str, Any], args: argparse.Namespace) -> str:
    """Validates one request spec and adds it; returns its id."""
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"request {i}: each line must be a JSON object, got {type(spec).__name__}")
    if "prompt_token_ids" in spec:
        ids = spec["prompt_token_ids"]
        if not isinstance(ids, list):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
    elif isinstance(spec.get("prompt"), str):
        if engine.tokenizer is None:
            raise InvalidRequestError("this model directory has no tokenizer: send prompt_token_ids")
        ids = engine.tokenizer.encode(spec["prompt"])
    else:
        raise InvalidRequestError("each request needs `prompt` (a string) or `prompt_token_ids`")
    stop, stop_ids = spec.get("stop", ()), spec.get("stop_token_ids", ())
    try:
        params = SamplingParams(
            max_tokens=spec.get("max_tokens", args.max_tokens),
            temperature=float(spec.get("temperature", args.temperature)),
            top_p=float(spec.get("top_p", args.top_p)),
            top_k=spec.get("top_k", args.top_k),
            seed=spec.get("seed", args.seed),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),  # one string is one stop, as in the API
            ignore_eos=bool(spec.get("ignore_eos", args.ignore_eos)),
            stop_token_ids=tuple(stop_ids),
            skip_special_tokens=bool(spec.get("skip_special_tokens", True)),
        )
    except TypeError as exc:  # a field of the wrong JSON type (null, a number where a list belongs)
        raise InvalidRequestError(f"request {i}: a field has the wrong type ({exc})") from None
    rid = f"cli-{i}"
    engine.add_request(rid, ids, params)
    return rid


def _with_engine(run: Callable[[LLMEngine, argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Runs a command on a fresh engine and stops its worker processes afterwards, however it ends."""
    engine = LLMEngine(_engine_config(args))
    try:
        return run(engine, args)
    finally:
        engine.shutdown()


def cmd_generate(engine: LLMEngine, args: argparse.Namespace) -> int:
    try:
        specs = _read_requests(args)
    except (InvalidRequestError, json.JSONDecodeError) as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}", file=sys.stderr)
        return 2
    results: list[RequestOutput | str] = []
    for i, spec in enumerate(specs):
        try:
            results.append(_submit(engine, i, spec, args))
        except (InvalidRequestError, TypeError, ValueError) as exc:
            results.append(f"error: {exc}")
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    failed = 0
    for r in results:
        if r.startswith("error: "):
            failed += 1
            line: dict[str, Any] = {"error": r.removeprefix("error: ")}
            print(json.dumps(line) if args.json else r)
            continue
        o = final[r]
        if args.json:
            print(json.dumps({"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                              "prompt_tokens": o.num_prompt_tokens, "cached_tokens": o.num_cached_tokens}))
        else:
            print(o.text)
    if args.json:
        print(json.dumps({"stats": engine.stats()}))
    return 2 if failed == len(results) else 0


def cmd_chat(engine: LLMEngine, args: argparse.Namespace) -> int:
    """Interactive chat: one user line in, the streamed assistant reply out."""
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("chat with", args.model, "- empty line or Ctrl-D quits", flush=True)
    for turn, line in enumerate(sys.stdin):
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = engine.tokenizer.encode_chat(messages)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        engine.add_request(f"chat-{turn}", ids, params)
        reply = ""
        while engine.has_unfinished():
            for o in engine.step():
                print(o.text_delta, end="", flush=True)
                reply = o.text
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write the tiny random-weight checkpoint")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--fp8", action="store_true", help="FP8 e4m3 linear weights with 128x128 block scales")
    tiny.add_argument("--config", type=Path, default=None,
                      help="JSON file of config.json fields replacing the tiny ones (any shape, e.g. GLM-5.3's)")

    gen = sub.add_parser("generate", help="run requests to completion")
    _add_engine_flags(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-token-ids")
    src.add_argument("--requests", type=Path, help="JSON lines: prompt or prompt_token_ids, optional sampling")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")

    chat = sub.add_parser("chat", help="interactive chat through the chat template")
    _add_engine_flags(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--seed", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "make-tiny":
            overrides = json.loads(args.config.read_text()) if args.config else None
            make_tiny(args.out, seed=args.seed, overrides=overrides, fp8=args.fp8)
            return 0
        return _with_engine(cmd_generate if args.command == "generate" else cmd_chat, args)
    except (InvalidRequestError, ValueError, OSError) as exc:  # the user's input or files: no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2

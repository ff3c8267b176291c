"""The synchronous engine core: validate and admit requests, step, emit outputs.

One `step()` = schedule and launch a step (forward and sampling run on the
ranks), then read the previous step's tokens, apply stop conditions and free
what finished (`async_scheduling`; off, the step's own tokens are read before
`step()` returns). With speculative decoding a step is launched before the one it
continues is read, as if that one accepted every draft; the ranks move it back by
the drafts rejected (`_speculative_step`). Everything is single-threaded here;
`AsyncEngine` drives it from a background thread. This process is the replica's
driver: it owns scheduling, page accounting and residency decisions, and runs the model through an
executor (engine/executors/) on one rank in this process or on
`tensor_parallel_size` ranks in worker processes. A failed rank makes `step()`
raise `WorkerError`, which ends the async loop and marks the replica unhealthy.
A failure while sampling or emitting one request's token (its sampling values,
stop strings, detokenizer) ends that request alone, with an output carrying the
error: its pages are freed and the batch goes on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executors.executor import PendingOutput, make_executor
from engine.kv_cache_manager import KVCacheManager
from engine.kv_layout import KVLayout
from engine.memory_plan import GIB, MemoryBudget, num_gpu_pages, request_footprint
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.mtp import draft_layers
from engine.rank.decode_graphs import GraphConfig
from engine.rank.worker import WorkerSpec
from engine.request import PENDING, FinishReason, InvalidRequestError, Request, RequestStatus, SamplingParams
from engine.sampler import SamplingBatch
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from engine.spec_decode_stats import SpecDecodeStats
from engine.tokenizer import Tokenizer
from engine.tp.sharding import check_shardable
from kernels.resolve import MAX_HOT_SLOTS
from residency.config import HiSparseConfig
from residency.host_pool import HostPool
from residency.manager import ResidencyManager
from residency.policies import make_policy
from residency.stats import StateCounter

logger = logging.getLogger(__name__)

# OpenAI's code for a request longer than the model can hold: agents trim their history on it.
_TOO_LONG = "context_length_exceeded"


@dataclass
class RequestOutput:
    """What a request produced in one step (deltas) and so far (totals). The tokens so far are the request's
    output list, which only grows, read up to this output's count: a copy of them in every output of every
    step grew with the output (5 us a request at 4,000 tokens on this project's CPU, 0.3 ms a step at B = 64)."""

    request_id: str
    new_token_ids: list[int]
    output_tokens: list[int]  # the request's output list (append-only), this output's tokens first
    num_output_tokens: int
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # why the engine ended this request (finish_reason "error"); None otherwise

    @property
    def token_ids(self) -> list[int]:
        """Every token the request produced up to this output."""
        return self.output_tokens[: self.num_output_tokens]


@dataclass
class _TextState:
    """Detokenized text of one request, with stop-string look-behind."""

    detok: IncrementalDetokenizer | None
    text: str = ""
    emitted: int = 0
    stop_hit: bool = False
    seed: int = 0  # the request's sampling seed (its own, or the next of the engine's sequence)


@dataclass
class _SpecLaunch:
    """A launched verify-and-draft step whose tokens are not read yet. Its requests' state counts it as if
    the target accepted every draft (`num_pending_tokens`, computed rows, k pending drafts); reading it takes
    the rejected rows back."""

    pending: PendingOutput
    out: SchedulerOutput
    completing: list[ScheduledRequest]  # the sampling requests, in the step's order
    num_drafts: list[int]  # drafts each verifies (taken at launch: `ScheduledRequest` reads the live state)

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.completing]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} (engine.device in a Serve config, --device on the CLI) "
                               f"but this process sees no CUDA device (torch {torch.__version__}, built for CUDA "
                               f"{torch.version.cuda}); use device cpu, or run the replica where a GPU is")
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        # Checkpoints without tokenizer files still serve token-id requests (text stays empty).
        has_tokenizer = (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(config.model) if has_tokenizer else None
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len >= MAX_HOT_SLOTS:  # a hot lease holds up to a request's host-only tokens
            raise ValueError(f"max_model_len {self.max_model_len} must be below {MAX_HOT_SLOTS} tokens (the "
                             "largest hot buffer the residency resolve serves)")
        self.num_speculative_tokens = config.num_speculative_tokens
        if self.num_speculative_tokens and self.model_config.num_nextn_predict_layers < 1:
            raise ValueError("num_speculative_tokens needs a model with an MTP layer (num_nextn_predict_layers)")
        self.layout = KVLayout.for_model(self.model_config, config.kv_format,
                                         draft_layers=draft_layers(self.num_speculative_tokens))
        self.device = torch.device(config.device)
        weight_format = config.weight_format(self.model_config.fp8_block_checkpoint)
        check_shardable(self.model_config, config.tensor_parallel_size, weight_format.kind == "fp8")
        spec = WorkerSpec(
            model_dir=config.model,
            dtype=config.torch_dtype,
            kv_format=config.kv_format,
            device_type=self.device.type,
            tp_size=config.tensor_parallel_size,
            random_seed=config.seed if config.random_weights else None,
            weight_format=weight_format,
            graphs=GraphConfig(config.enforce_eager, config.max_num_seqs, self.max_model_len),
            num_speculative_tokens=self.num_speculative_tokens,
        )
        self.executor = make_executor(spec, config.executor, self.device)
        try:
            self._build(config)
        except BaseException:
            self.executor.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        """The driver's state around the ranks: pool accounting, residency, scheduler."""
        self.runner = ModelRunner(self.executor, self.layout, self.num_speculative_tokens)
        num_pages = config.num_gpu_pages or self._plan_gpu_pages()
        self.executor.init_kv_pool(num_pages)
        self.kv = KVCacheManager(self.layout, num_pages, config.enable_prefix_cache)
        self.residency = self._build_residency(config.hisparse)
        self.kv.residency = self.runner.residency = self.residency
        self.kv.copy_pages = self.executor.copy_pages
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.kv, make_policy(config.hisparse.policy, self.residency))
        self.state_counter = StateCounter()
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.eos_token_ids = set(tokenizer_eos) | set(self.model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._seed_counter = config.seed
        self.num_steps = 0
        self.spec_stats = SpecDecodeStats()
        self._replayed_drafts: dict[str, list[int]] = {}  # request id -> the output its drafts are read from
        self._in_flight: tuple[PendingOutput, list[Request]] | None = None  # launched, outputs not yet read
        self._spec_in_flight: _SpecLaunch | None = None  # the same for a verify-and-draft step
        self.num_continued_steps = 0  # verify-and-draft steps launched before the step they continue was read

    def _plan_gpu_pages(self) -> int:
        """Pool size: on a GPU what `gpu_memory_utilization` leaves after the loaded weights and the
        activation reserve, on the fullest rank (every rank holds the whole pool); on a CPU `kv_cache_gib`."""
        config = self.config
        if self.device.type != "cuda":
            return max(1, int(config.kv_cache_gib * GIB) // self.layout.page_bytes)
        reserve = int(config.activation_reserve_gib * GIB)
        pages = min(
            num_gpu_pages(MemoryBudget(total, config.gpu_memory_utilization, total - free, reserve), self.layout)
            for free, total in self.executor.memory_info()
        )
        if pages < 1:
            raise ValueError("no GPU memory left for KV pages: lower activation_reserve_gib or raise utilization")
        return pages

    def _build_residency(self, hs: HiSparseConfig) -> ResidencyManager | None:
        if not hs.uses_host:
            return None
        host_pages = int((hs.host_pool_gib + hs.offload_pool_gib) * 2**30) // self.layout.page_bytes
        if host_pages < 1:
            raise ValueError(f"host_pool_gib={hs.host_pool_gib} holds no {self.layout.page_bytes}-byte page")
        host = HostPool(self.executor.create_host_pool(host_pages, self.layout.page_bytes))
        return ResidencyManager(hs, self.kv.cache, self.executor, host, self.model_config.index_topk,
                                self.layout.indexer_tokens_per_page)

    # --- submission -----------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises `InvalidRequestError` with a client-facing message for a request that cannot run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        # checked in C (types, then the extremes) and searched item by item only when wrong: an agent's
        # prompt has up to a million ids, and this runs on the engine's thread
        if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab]
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; this model's maximum context length is {self.max_model_len} "
                "and at least one token must be generated", "prompt", _TOO_LONG
            )
        longest = min(n + params.max_tokens, self.max_model_len)
        if self._fits(longest):
            return
        pages = self.kv.pages_for_tokens(longest)
        # lowering max_tokens helps only when the prompt and its first token fit
        at_fault, remedy = ("max_tokens", "lower max_tokens") if self._fits(n + 1) else ("prompt", "shorten the prompt")
        raise InvalidRequestError(
            f"the request needs up to {longest} tokens of KV ({pages} pages) but the KV pool has "
            f"{self.kv.pool.num_pages} pages; {remedy}", at_fault, _TOO_LONG
        )

    def _fits(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens can run: in the GPU pool whole, or through the host pool."""
        return self.kv.pages_for_tokens(num_tokens) <= self.kv.pool.num_pages or self._fits_with_host(num_tokens)

    def _fits_with_host(self, num_tokens: int) -> bool:
        """Whether `hybrid` can run a request the GPU pool cannot hold whole: the GPU keeps its
        indexer pages, tail, hot buffer and one prefill chunk; its completed pages live on host."""
        if self.residency is None or not self.config.hisparse.traits.runs_from_host:
            return False
        fp = request_footprint(self.layout, num_tokens, "hybrid", self.residency.hot.hot_rows)
        chunk = min(self.config.max_num_batched_tokens, self.scheduler.max_chunk_tokens)
        gpu = fp.gpu_pages + -(-chunk // self.layout.page_size)
        return gpu <= self.kv.pool.num_pages and fp.host_pages <= self.residency.host.num_pages

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic())
        seed = params.seed
        if seed is None:
            seed, self._seed_counter = self._seed_counter, self._seed_counter + 1
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        # Queued and registered only once everything is built, so a failed add leaves nothing behind.
        self.scheduler.add(req)
        self._requests[request_id] = req
        self._text[request_id] = _TextState(detok, seed=seed)

    def abort_request(self, request_id: str) -> bool:
        """Ends a request in any state and frees its pages; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        self._text.pop(request_id, None)
        self._replayed_drafts.pop(request_id, None)
        if req is None or req.is_finished:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        """Requests wait, run, or have a token in a launched step not yet read."""
        in_flight = self._in_flight is not None and not all(r.is_finished for r in self._in_flight[1])
        spec = self._spec_in_flight is not None and not all(r.is_finished for r in self._spec_in_flight.requests)
        return self.scheduler.has_unfinished() or in_flight or spec

    # --- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step, and returns the outputs of the step launched before it
        (`async_scheduling`: the host prepares a step while the device runs the previous one) or of this
        one. A request the previous step finished may already be in this step: its row is discarded."""
        if self.num_speculative_tokens:
            return self._speculative_step()
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            completing = [s.request for s in out.scheduled if s.completes]
            sampling = SamplingBatch.build(
                [r.params for r in completing], [self._text[r.request_id].seed for r in completing],
                [r.num_output_positions for r in completing], self.model_config.vocab_size,
            )
            launched = (self.runner.launch(out.scheduled, sampling), completing)
            for req in completing:
                req.num_pending_tokens += 1
            self.scheduler.after_step(out)
            self.num_steps += 1
            self._record_states()
        if not self.config.async_scheduling:
            return self._finish(launched) if launched is not None else []
        previous, self._in_flight = self._in_flight, launched
        return self._finish(previous) if previous is not None else []

    def _finish(self, launched: tuple[PendingOutput, list[Request]]) -> list[RequestOutput]:
        """Reads a launched step's tokens and appends them (stop conditions, text)."""
        pending, completing = launched
        tokens = self.runner.collect(pending)
        outputs = []
        for req, token in zip(completing, tokens):
            if req.is_finished:  # ended (stop, abort) while this step ran: its token is discarded
                continue
            req.num_pending_tokens -= 1
            outputs.append(self._complete(req, token))
        return outputs

    def _speculative_step(self) -> list[RequestOutput]:
        """One step that verifies every completing request's drafts and proposes its next ones
        (engine/rank/speculative.py), and the outputs of the step before it (`async_scheduling`; off, of this
        one). Which rows a step computes depends on how many drafts the one before accepted, so a step is
        launched before the previous one is read only when it continues it (`_continues`): the same requests,
        every one decoding with all its drafts and room for another step. The host then schedules it as if
        every draft of the previous step were accepted, and the ranks shift its rows back by the drafts
        rejected there, from that step's results on the device (`StepInput.continues`). Otherwise the
        previous step is read first."""
        previous = self._spec_in_flight
        outputs: list[RequestOutput] = []
        if previous is not None and not self._continues(previous):
            outputs, previous = self._read_speculative(previous, None), None
        self._spec_in_flight = None
        out = self.scheduler.schedule()
        if previous is not None and not all(s.completes and s.num_new_tokens == self.num_speculative_tokens + 1
                                            for s in out.scheduled):
            raise RuntimeError("a continued speculative step was scheduled with another shape")
        launched = self._launch_speculative(out, previous is not None) if out.scheduled else None
        if previous is not None:
            outputs += self._read_speculative(previous, launched)
        if launched is not None and not self.config.async_scheduling:
            return outputs + self._read_speculative(launched, None)
        self._spec_in_flight = launched
        return outputs

    def _continues(self, launch: _SpecLaunch) -> bool:
        """Whether the next step may be launched before `launch` is read: asynchronous scheduling on, nothing
        swapped, nothing waiting unless every sequence slot is taken (so nothing is admitted), `launch` verified
        k drafts for every running request (the graph path's shape, no prefill row), each has room for k + 1
        more tokens after `launch`'s (and replayed drafts enough output to replay), free pages cover everyone's
        next rows (so scheduling cannot preempt or demote), and a request with host-only pages has a hot lease
        that already serves k + 1 rows a step, with no promotion planned (its pages would come from the free
        ones the step counts on)."""
        k = self.num_speculative_tokens
        sched = self.scheduler
        if not self.config.async_scheduling or self.config.enforce_eager or sched.swapped:
            return False
        if sched.waiting and len(sched.running) < sched.config.max_num_seqs:  # one may be admitted
            return False
        if len(launch.out.scheduled) != len(launch.completing) or sched.running != launch.requests:
            return False
        if len(sched.running) * (k + 1) > sched.config.max_num_batched_tokens:
            return False
        needed = 0
        for s, drafts in zip(launch.completing, launch.num_drafts):
            req = s.request
            if s.num_new_tokens != k + 1 or drafts != k:
                return False
            if req.hot is not None and not self.kv.residency.hot.serves(req, k + 1):  # a lease implies a host tier
                return False
            replayed = self._replayed_drafts.get(req.request_id)
            if replayed is not None and len(replayed) < len(req.output_token_ids) + 1 + 2 * k:
                return False
            if (req.params.max_tokens - req.num_output_positions < k + 1
                    or self.max_model_len - req.num_tokens < k + 1):
                return False
            needed += self.kv.pages_needed(req, req.num_computed_tokens + k + 1)
        if needed > self.kv.num_available:
            return False
        return not any(r.hot is not None for r in sched.running) or not sched.policy.plan(sched).promote

    def _launch_speculative(self, out: SchedulerOutput, continues: bool) -> _SpecLaunch:
        """Launches `out` and counts it in its requests' state as if every draft were accepted."""
        completing = [s for s in out.scheduled if s.completes]
        params, seeds, positions = [], [], []
        for s in completing:  # row j of a request samples its output position as decoding one token a step would
            req = s.request
            rows = 1 + s.num_drafts
            params += [req.params] * rows
            seeds += [self._text[req.request_id].seed] * rows
            positions += range(req.num_output_positions, req.num_output_positions + rows)
        sampling = SamplingBatch.build(params, seeds, positions, self.model_config.vocab_size)
        replayed = self._replay_windows(completing) if continues else None
        num_drafts = [s.num_drafts for s in completing]
        launch = _SpecLaunch(self.runner.launch(out.scheduled, sampling, continues, replayed), out, completing,
                             num_drafts)
        self.num_steps += 1
        self.num_continued_steps += continues
        for s, drafts in zip(completing, num_drafts):
            s.request.num_pending_tokens += drafts + 1
            s.request.draft_token_ids = [PENDING] * self.num_speculative_tokens
        self.scheduler.advance(out)
        return launch

    def _replay_windows(self, completing: list[ScheduledRequest]) -> torch.Tensor | None:
        """For a continued step, each request's replayed output from the one after its first unread token on,
        2k tokens (the rank drafts from the accepted count on), -1 without replayed drafts; None if none has."""
        k = self.num_speculative_tokens
        if not any(s.request.request_id in self._replayed_drafts for s in completing):
            return None
        rows = []
        for s in completing:
            replayed, first = self._replayed_drafts.get(s.request.request_id), len(s.request.output_token_ids) + 1
            rows.append([-1] * 2 * k if replayed is None else replayed[first : first + 2 * k])
        return torch.tensor(rows, dtype=torch.long)

    def _read_speculative(self, launch: _SpecLaunch, later: _SpecLaunch | None) -> list[RequestOutput]:
        """Reads `launch`'s tokens: each request's accepted drafts and the token after them become outputs
        (stop conditions, text), the rejected rows are taken back, and its next drafts are the proposals,
        unless `later` (launched since, continuing it) already verifies them."""
        result = self.runner.collect(launch.pending)
        k = self.num_speculative_tokens
        n, r = sum(launch.num_drafts) + len(launch.num_drafts), len(launch.completing)
        sampled, accepted_counts, proposals = result[:n], result[n : n + r], result[n + r :]
        # rows `later` counted for each request it continues (their drafts are already in it)
        later_rows = {s.request.request_id: s.num_new_tokens for s in later.completing} if later is not None else {}
        outputs: list[RequestOutput] = []
        rejected: dict[str, int] = {}
        finishing: list[tuple[Request, FinishReason]] = []  # ended by a token of this step: finished below
        start = 0
        for i, (s, drafts) in enumerate(zip(launch.completing, launch.num_drafts)):
            req, accepted = s.request, accepted_counts[i]
            tokens = sampled[start : start + accepted + 1]
            start += drafts + 1
            if req.is_finished:  # ended (abort, failure) while the step ran: its tokens are discarded
                continue
            req.num_pending_tokens -= drafts + 1
            self.spec_stats.record(drafts, accepted)
            rejected[req.request_id] = drafts - accepted
            ended, done = len(finishing), False
            for token in tokens:
                outputs.append(self._complete(req, token, finishing))
                done = req.is_finished or len(finishing) > ended  # failed, or stopped by this token
                if done:
                    break
            if done:
                req.draft_token_ids = []
                self._replayed_drafts.pop(req.request_id, None)
            elif req.request_id not in later_rows:
                req.draft_token_ids = self._next_drafts(req, proposals[i * k : (i + 1) * k])
        # The accepted rows count and their pages register (the accepted drafts are outputs now), also for the
        # requests this step ends; then those end.
        self.scheduler.settle(launch.out, rejected, later_rows)
        for req, reason in finishing:
            self.scheduler.finish(req, reason)
        self._record_states()
        return outputs

    def replay_drafts(self, request_id: str, output_token_ids: list[int]) -> None:
        """Drafts `request_id` from `output_token_ids` (an earlier run's output for the same prompt) instead of
        the MTP layer's proposals, which still run: a draft source whose acceptance is known (every draft
        accepted when that output is this run's own), for benchmarks and tests of the verification."""
        if not self.num_speculative_tokens:
            raise ValueError("replayed drafts need num_speculative_tokens > 0")
        if request_id not in self._requests:
            raise KeyError(f"unknown request {request_id!r}")
        self._replayed_drafts[request_id] = list(output_token_ids)

    def _next_drafts(self, req: Request, proposals: list[int]) -> list[int]:
        """The drafts `req` verifies next: its replayed output's if set, else the MTP layer's `proposals`; no
        more than its output tokens left after the next one, at positions inside the context limit."""
        left = req.params.max_tokens - len(req.output_token_ids) - 1
        limit = max(0, min(self.num_speculative_tokens, left, self.max_model_len - req.num_tokens))
        replayed = self._replayed_drafts.get(req.request_id)
        if replayed is not None:
            return replayed[len(req.output_token_ids) : len(req.output_token_ids) + limit]
        return proposals[:limit]

    def _complete(self, req: Request, token: int,
                  finishing: list[tuple[Request, FinishReason]] | None = None) -> RequestOutput:
        """Appends `req`'s token (stop conditions, text); a failure here ends `req` alone, not the step.
        With `finishing`, a request its token ends is listed there for the caller to finish (its pages are
        still to register), not finished here."""
        try:
            return self._append(req, token, finishing)
        except Exception as exc:  # noqa: BLE001 - the request gets the failure; the batch goes on
            logger.exception("request %s failed; ending it alone", req.request_id)
            return self._fail(req, exc)

    def _fail(self, req: Request, exc: Exception) -> RequestOutput:
        """Ends `req` with `FinishReason.ERROR`, frees its pages and reports the error in its output."""
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ERROR)
        self._requests.pop(req.request_id, None)
        state = self._text.pop(req.request_id, None)
        text = state.text[: state.emitted] if state is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            output_tokens=req.output_token_ids,
            num_output_tokens=len(req.output_token_ids),
            text_delta="",
            text=text,
            finished=True,
            finish_reason=FinishReason.ERROR.value,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=f"{type(exc).__name__}: {exc}",
        )

    def _append(self, req: Request, token: int,
                finishing: list[tuple[Request, FinishReason]] | None = None) -> RequestOutput:
        req.output_token_ids.append(token)
        state = self._text[req.request_id]
        p = req.params
        is_stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        if not is_stop_token and state.detok:  # the stop token itself is not part of the text
            state.text += state.detok.step(token)
        reason = FinishReason.STOP if is_stop_token else self._stop_reason(req, state)
        if reason is not None:
            if not state.stop_hit and state.detok:
                state.text += state.detok.flush()
            if finishing is None:
                self.scheduler.finish(req, reason)
            else:
                finishing.append((req, reason))
        delta_end = len(state.text) if reason is not None else self._safe_text_end(req, state)
        delta = state.text[state.emitted : delta_end]
        state.emitted = max(state.emitted, delta_end)
        output = RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            output_tokens=req.output_token_ids,
            num_output_tokens=len(req.output_token_ids),
            text_delta=delta,
            text=state.text[:delta_end],
            finished=reason is not None,
            finish_reason=reason.value if reason is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        if reason is not None:
            self._requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
        return output

    def _stop_reason(self, req: Request, state: _TextState) -> FinishReason | None:
        """The text ends before the earliest stop string in it, whichever the list names first."""
        p = req.params
        found = [at for stop in p.stop if (at := state.text.find(stop, max(0, state.emitted - len(stop)))) >= 0]
        if found:
            state.text, state.stop_hit = state.text[: min(found)], True
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_known_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _safe_text_end(req: Request, state: _TextState) -> int:
        """Text that may still turn into a stop string is held back until it cannot."""
        hold = max((len(s) - 1 for s in req.params.stop), default=0)
        return max(state.emitted, len(state.text) - hold)

    # --- convenience ----------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Submits all prompts at once (so they batch) and runs until every one finishes."""
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]

    def _record_states(self) -> None:
        counts = {"waiting": len(self.scheduler.waiting), "swapped": len(self.scheduler.swapped)}
        for state in ("full", "mixed", "none"):
            counts[state] = 0
        for req in self.scheduler.running:
            counts[ResidencyManager.state(req)] += 1
        self.state_counter.record(counts)

    def stats(self) -> dict[str, Any]:
        kv = self.kv
        residency = {}
        if self.residency is not None:
            host = self.residency.host
            residency = dict(vars(self.residency.stats))
            residency.update(mirror_backlog=self.residency.mirror_backlog, host_pages=host.num_pages,
                             host_pages_in_use=host.num_in_use(), host_pages_cached=host.cache.num_cached,
                             hot_rows=self.residency.hot.hot_rows)
        return {
            "policy": self.config.hisparse.policy,
            "requests_by_state": self.state_counter.summary(),
            "swaps": self.scheduler.num_swaps,
            **residency,
            "num_pages": kv.pool.num_pages,
            "pages_in_use": kv.num_pages_in_use(),
            "pages_cached": kv.cache.num_cached,
            "pages_free": kv.pool.num_free,
            "prefix_cache_hit_tokens": kv.num_prefix_hit_tokens,
            "prefix_cache_queried_tokens": kv.num_prefix_queried_tokens,
            "prefix_cache_evictions": kv.cache.num_evicted,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            **self.spec_stats.as_dict(),
            "spec_decode_num_continued_steps": self.num_continued_steps,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }

    def check_health(self) -> None:
        """Raises `WorkerError` if a rank of this replica is gone (for health checks between steps)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the ranks' worker processes (nothing to stop with one rank)."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        """Accounting check used by tests after each step; also checks that every rank holds the
        hot leases the driver granted, with identical LRU tables."""
        self.kv.check_integrity()
        leased = {r.request_id for r in self._requests.values() if r.hot is not None}
        digests = self.executor.lease_digests()
        assert all(set(d) == leased for d in digests), "ranks' hot leases differ from the driver's"
        assert all(d == digests[0] for d in digests), "ranks' hot-buffer LRU tables diverged"
        held = {p for r in self.scheduler.running for p in r.mla_pages + r.indexer_pages if p is not None}
        assert len(held) <= self.kv.pool.num_used(), "requests hold more pages than are in use"
        for r in self.scheduler.waiting:
            assert not r.mla_pages and not r.indexer_pages, f"waiting request {r.request_id} holds pages"
            assert not r.host_pages and r.hot is None, f"waiting request {r.request_id} holds host pages"
        for r in self.scheduler.swapped:
            assert not r.indexer_pages and all(p is None for p in r.mla_pages)
        assert all(r.status is RequestStatus.RUNNING for r in self.scheduler.running)

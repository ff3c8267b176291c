"""One tensor-parallel rank: its weight shard, its replica of the KV pool, its attention ops.

The same class serves every executor: in the engine's own process when the
replica has one rank, in a worker process or a Ray actor otherwise. A rank
does what the driver tells it, in the order it was told: build the pool, map
the host pool, run forward steps, copy pages, open and close hot leases. Every
rank computes its vocabulary rows' logits, gathers all of them (lm_head is
split by vocabulary) and samples the same tokens from the same logits, so each rank holds the step's ids on its device
for the next step's inputs; rank 0's are read back. Decode steps run through
the rank's persistent buffers and, on a GPU, as captured CUDA graphs
(engine/rank/decode_graphs.py); a replica that drafts (speculative decoding)
verifies and drafts in every step (engine/rank/speculative.py), through its own
buffers and graphs when every request of the step decodes
(engine/rank/spec_graphs.py). Other steps, and every step under
`enforce_eager`, run eagerly from the step's own tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention_ops import AttentionOps, TorchAttentionOps
from engine.forward_batch import ForwardBatch, with_previous_tokens
from engine.kv_layout import KVFormat, KVLayout
from engine.linear import WeightFormat
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.mtp import draft_layers
from engine.page_tables import PageTableStore
from engine.rank.decode_graphs import DecodeGraphs, GraphConfig, scratch_slots
from engine.rank.spec_graphs import SpecGraphs
from engine.rank.speculative import speculative_step
from engine.rank.step import StepInput, StepOutput
from engine.sampler import SamplingBatch, sample
from engine.tp.tensor_parallel import TensorParallel
from engine.triton_ops import TritonAttentionOps
from engine.weights import load_weights, random_init
from residency.rank import TALLY_SIZE, RankResidency, counts_of
from residency.stats import ResolveCounts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of a replica is built from; picklable, it travels to worker processes."""

    model_dir: str
    dtype: torch.dtype
    kv_format: KVFormat
    device_type: str  # "cpu" or "cuda"; each rank is given its own device
    tp_size: int
    random_seed: int | None  # seeded random weights instead of the checkpoint
    weight_format: WeightFormat = WeightFormat()  # linear weights dense or FP8 block-scaled
    graphs: GraphConfig = GraphConfig()  # how decode steps run
    num_speculative_tokens: int = 0  # drafts a step from the MTP layer (built, with its KV rows, when > 0)


@dataclass
class _Staging:
    """Pinned host buffers one step's results are copied into."""

    tokens: torch.Tensor  # [max rows] int64
    counts: torch.Tensor  # [TALLY_SIZE] int64 resolve tally


class LaunchedStep:
    """A step a rank has queued; `output` waits for it (only for it: later steps may be queued behind)."""

    def __init__(self, staging: _Staging, num_tokens: int, has_counts: bool, event: torch.cuda.Event | None) -> None:
        self._staging, self._num_tokens, self._has_counts, self._event = staging, num_tokens, has_counts, event

    def output(self) -> StepOutput:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._staging.tokens[: self._num_tokens].tolist()
        counts = counts_of(self._staging.counts.tolist()) if self._has_counts else ResolveCounts()
        return StepOutput(tokens, counts)


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        cfg = ModelConfig.from_dir(spec.model_dir)
        num_draft_layers = draft_layers(spec.num_speculative_tokens)
        self.layout = KVLayout.for_model(cfg, spec.kv_format, draft_layers=num_draft_layers)
        self.index_topk = cfg.index_topk
        tp = TensorParallel(rank, spec.tp_size)
        self.model = build_model(cfg, tp, spec.weight_format, spec.dtype, device, num_draft_layers)
        self.model.hold_float32_parts()
        if spec.random_seed is not None:
            random_init(self.model, spec.random_seed)
        else:
            load_weights(self.model, spec.model_dir, spec.dtype)
        self.model.prepare_drafting()
        self.model.eval()
        if device.type == "cuda":  # the pool is sized from the free memory: return the loading's temporaries first
            torch.cuda.empty_cache()
        # Triton sparse attention on GPUs; the PyTorch reference elsewhere.
        ops = TritonAttentionOps if device.type == "cuda" else TorchAttentionOps
        self.ops: AttentionOps = ops(self.layout)
        self.kv_pool = torch.empty(0, self.layout.page_bytes, dtype=torch.uint8, device=device)
        self.residency: RankResidency | None = None  # set when the replica has a host tier
        self.graph_config = spec.graphs
        self.graphs: DecodeGraphs | None = None  # set with the pool unless enforce_eager
        self.spec_graphs: SpecGraphs | None = None  # instead, when the replica drafts
        rows, pin = spec.graphs.max_batch, device.type == "cuda"
        self.last_tokens = torch.zeros(rows, dtype=torch.long, device=device)  # the last step's sampled ids
        # A speculative step answers k + 1 sampled tokens, the accepted count and k drafts per request.
        self.num_speculative_tokens = spec.num_speculative_tokens
        results = rows * (2 * spec.num_speculative_tokens + 2)
        # Two sets: a step's results are read after the next step is queued, before the one after.
        self._staging = [_Staging(torch.zeros(results, dtype=torch.long, pin_memory=pin),
                                  torch.zeros(TALLY_SIZE, dtype=torch.long, pin_memory=pin)) for _ in range(2)]
        self.num_launched = 0
        self._spec_graph_launch = -1  # `num_launched` at the last speculative step run through the graphs' buffers
        self.page_tables = PageTableStore()  # the last step's page table rows (engine/page_tables.py)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of this rank's GPU after its weights; (0, 0) off the GPU."""
        if self.device.type != "cuda":
            return 0, 0
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def init_kv_pool(self, num_pages: int) -> None:
        """This rank's replica of the page pool, sized after the weights so the free memory is known, and
        its decode graphs. One page more than the driver's is the scratch page decode padding writes."""
        pool = torch.zeros(num_pages + 1, self.layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.kv_pool = pool[:num_pages]
        self._pool = pool  # with the scratch page, where speculative drafting writes its throwaway rows
        rows = torch.arange(self.graph_config.max_batch, device=self.device)
        self._scratch_slots = scratch_slots(num_pages, self.layout.page_size, rows)
        logger.info(
            "rank %d KV pool: %d pages x %.2f MiB (%s rows)", self.rank, num_pages, self.layout.page_bytes / 2**20,
            self.layout.kv_format,
        )
        if self.graph_config.enforce_eager:
            return
        if self.num_speculative_tokens:  # every step verifies and drafts: no plain decode steps to capture
            self.spec_graphs = SpecGraphs(self.graph_config, self.model, self.layout, self.ops, pool, num_pages,
                                          lambda logits, sampling: self.sample_logits(logits, sampling),
                                          self.num_speculative_tokens)
            return
        # Looked up at each call, so a test's wrapper of `sample_logits` sees uncaptured steps too.
        self.graphs = DecodeGraphs(self.graph_config, self.model, self.layout, self.ops, pool, num_pages,
                                   lambda logits, sampling: self.sample_logits(logits, sampling))
        self.graphs.capture_common(self.residency)

    def attach_host_pool(self, host: torch.Tensor) -> None:
        self.residency = RankResidency(self.layout.group_offsets, self.layout.group_run_bytes, self.kv_pool, host)
        self.residency.warm_up(self.index_topk)

    def execute_model(self, step: StepInput) -> StepOutput:
        return self.launch_model(step).output()

    def launch_model(self, step: StepInput) -> LaunchedStep:
        """Queues `step` on the device and returns at once: its token ids and resolve counts are copied to
        pinned host memory behind it, so the host can prepare the next step while this
        one runs. Each step's sampled ids also stay on the device (`last_tokens`), where the next step
        reads the inputs the host has not seen yet (`StepInput.prev_rows`)."""
        self._after_mirrors()
        step = step.with_page_tables(self.page_tables)
        key = self.graphs.key_for(step, self.residency) if self.graphs is not None else None
        spec_key = self.spec_graphs.key_for(step, self.residency) if self.spec_graphs is not None else None
        if step.continues and (spec_key is None or self._spec_graph_launch != self.num_launched - 1):
            raise RuntimeError("a continued speculative step must follow one run through the same buffers")
        if spec_key is not None:
            tokens = self.spec_graphs.launch(spec_key, step, self.residency)
            self._spec_graph_launch = self.num_launched
        elif step.draft is not None:
            tokens = self._speculative(step)
        elif key is not None:
            tokens = self.graphs.launch(key, step, self.residency, self.last_tokens)
        else:
            tokens = self._eager(step)
        staging = self._staging[self.num_launched % len(self._staging)]
        self.num_launched += 1
        if step.draft is None:
            n = step.num_logits
            self.last_tokens[:n].copy_(tokens[:n])  # the next step's unread inputs
        else:  # a speculative step's inputs the host has not read come from its results (SpecGraphs._continue)
            n = int(tokens.shape[0])
        staging.tokens[:n].copy_(tokens[:n], non_blocking=True)
        resolves = self.residency is not None and bool(step.nonresident)  # only these rows add to the tally
        if resolves:
            self.residency.counts_into(staging.counts)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return LaunchedStep(staging, n, resolves, event)

    def _eager(self, step: StepInput) -> torch.Tensor:
        batch = ForwardBatch.from_step(step, self.layout, self.device, self.residency)
        if step.prev_rows is not None:
            batch.input_ids = with_previous_tokens(batch.input_ids, step.prev_rows.to(self.device, non_blocking=True),
                                                  self.last_tokens)
        hidden = self.model.hidden_states(batch, self.kv_pool, self.layout, self.ops)
        return self.sample_logits(self.model.logits(hidden), step.sampling.to(self.device))

    def _speculative(self, step: StepInput) -> torch.Tensor:
        """Verifies the step's drafts and proposes the next (engine/rank/speculative.py); eager."""
        batch = ForwardBatch.from_step(step, self.layout, self.device, self.residency)
        return speculative_step(self.model, batch, self._pool, self._scratch_slots, self.layout, self.ops,
                                step.sampling.to(self.device), self.sample_logits, step.draft.to(self.device))

    def sample_logits(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        """The token ids of `logits` [S, V] (a method, so a test can watch the logits of an eager or an
        uncaptured step)."""
        return sample(logits, sampling)

    def close(self) -> None:
        """Drops the decode graphs (and with them the graphs' hold on this worker and its pool)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.spec_graphs is not None:
            self.spec_graphs.close()
            self.spec_graphs = None

    # --- residency, as the driver decided it -------------------------------------------

    def _after_mirrors(self) -> None:
        """Orders what comes next (a forward, page writes) after the mirrors already issued."""
        if self.residency is not None:
            self.residency.order_after_mirrors()

    def _host_tier(self) -> RankResidency:
        if self.residency is None:
            raise RuntimeError("this replica has no host tier")
        return self.residency

    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> torch.cuda.Event | None:
        return self._host_tier().mirror(gpu_ids, host_ids)

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> torch.cuda.Event | None:
        """Queues the copies (residency/rank.py); the event marks them done (None: done already)."""
        return self._host_tier().load(host_ids, gpu_ids)

    def wait_for_loads(self) -> None:
        if self.residency is not None:
            self.residency.wait_for_loads()

    def read_pages(self, gpu_ids: Sequence[int]) -> torch.Tensor:
        """Whole pages of this rank's pool, on the CPU (every rank holds the same bytes)."""
        return self.kv_pool[torch.tensor(list(gpu_ids), dtype=torch.long, device=self.device)].cpu()

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        self._after_mirrors()
        idx = [torch.tensor(list(ids), dtype=torch.long, device=self.device) for ids in (src_ids, dst_ids)]
        self.kv_pool[idx[1]] = self.kv_pool[idx[0]]

    def write_pages(self, gpu_ids: Sequence[int], data: torch.Tensor) -> None:
        self._after_mirrors()
        self.kv_pool[torch.tensor(list(gpu_ids), dtype=torch.long, device=self.device)] = data.to(self.device)

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self._host_tier().open_lease(request_id, pages, capacity)

    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self._host_tier().resize_lease(request_id, pages, capacity)

    def close_lease(self, request_id: str) -> None:
        self._host_tier().close_lease(request_id)

    def lease_digests(self) -> dict[str, str]:
        return self.residency.digests() if self.residency is not None else {}

"""A rank's speculative step: verify the drafts in one target forward, then draft again with the MTP layer.

Every sampling request brings its last known token and the drafts proposed for the positions after it
(k + 1 rows, all sampled). Each row's token is sampled exactly as decoding without drafts would sample
that output position (engine/sampler.py draws by seed and output position), and the drafts are accepted
while each equals the token sampled at the row before it: the output is the target's own, with greedy
and with seeded sampling, however good the drafts are. The accepted tokens plus the one sampled after
them (a + 1 tokens) are the step's output.

The MTP layer then runs once over every row of the step (it writes its KV rows there: row p reads the
target's hidden state at p and the token at p + 1, known or just sampled) and its output at each sampling
request's last accepted row gives the first draft. The further drafts iterate the layer on its own output
stream, one row per request, at the next positions. Those iterations reuse the selection of the step's
target pass (the target's last full layer's top-K, already resolved into KV slots, hot-buffer misses
copied): the residency resolve runs once per step, never per draft. Their KV rows go to the scratch
page: they would be computed again by the next step (its rows start at the first unverified position).

Drafts take the most probable token (`GlmMoeDsaForCausalLM.draft_tokens`: by FP8 copies of the head in an FP8
model); any choice keeps the output exact, the most probable one is the likeliest to be accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine.attention import Selection, StepContext
from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.model import GlmMoeDsaForCausalLM
from engine.rank.step import DraftInput
from engine.sampler import SamplingBatch


def accepted_drafts(tokens: torch.Tensor, input_ids: torch.Tensor, logits_rows: torch.Tensor,
                    draft: DraftInput) -> torch.Tensor:
    """Drafts accepted per sampling request [R]: leading drafts equal to the token sampled at the row before
    them. `tokens` [S] are the sampled tokens of the logits rows, `input_ids` [T] the step's inputs."""
    column = torch.arange(draft.num_speculative_tokens, device=tokens.device)
    verified = draft.logit_starts[:, None] + column[None, :]  # logits row before each draft
    valid = column[None, :] < draft.num_drafts[:, None]
    last = draft.logit_starts + draft.num_drafts
    draft_rows = logits_rows[torch.minimum(verified + 1, last[:, None])]
    match = (input_ids[draft_rows] == tokens[torch.minimum(verified, last[:, None])]) & valid
    return match.long().cumprod(dim=1).sum(dim=1)


@torch.inference_mode()
def speculative_step(model: GlmMoeDsaForCausalLM, batch: ForwardBatch, kv_pool: torch.Tensor,
                     scratch_slots: torch.Tensor, layout: KVLayout, ops: AttentionOps, sampling: SamplingBatch,
                     sample: Callable[[torch.Tensor, SamplingBatch], torch.Tensor], draft: DraftInput) -> torch.Tensor:
    """One verify-and-draft step. Returns int64 [S + R + R * k] on the device: the token sampled at each
    logits row, the drafts each sampling request accepted, and its k new drafts. `kv_pool` includes the
    scratch page that `scratch_slots` [>= R] point into (the drafting iterations' KV rows)."""
    [mtp] = model.mtp_layers
    hidden, selection, ctx = model.target_pass(batch, kv_pool, layout, ops)
    rows = batch.logits_rows
    tokens = sample(model.logits(hidden[rows]), sampling)
    accepted = accepted_drafts(tokens, batch.input_ids, rows, draft)
    base = rows[draft.logit_starts + accepted]  # each sampling request's last accepted row

    next_ids = draft.next_ids.clone()
    next_ids[rows] = tokens
    stream, normed = mtp.draft(model.model.embed_tokens(next_ids), hidden, ctx, selection)
    proposals = [model.draft_tokens(normed[base])]

    replayed = Selection(selection.slots[base], selection.lens[base])
    stream = stream[base]
    writes = scratch_slots[: base.shape[0]]
    iterations = draft.num_speculative_tokens - 1 if base.numel() else 0  # a step may sample nothing
    if iterations:  # every iteration's positions and rotary tables at once, [iteration, request]
        ahead = torch.arange(1, iterations + 1, device=base.device)
        positions = batch.positions[base][None, :] + ahead[:, None]
        cos, sin = (t.view(*positions.shape, -1) for t in model.rotary(positions.reshape(-1), stream.dtype))
    for i in range(iterations):
        step_batch = dataclasses.replace(batch, input_ids=proposals[-1], positions=positions[i],
                                         mla_write_slots=writes)
        step_ctx = StepContext(step_batch, cos[i], sin[i], kv_pool, layout, ops)
        stream, normed = mtp.draft(model.model.embed_tokens(proposals[-1]), stream, step_ctx, replayed)
        proposals.append(model.draft_tokens(normed))
    drafts = torch.stack(proposals, dim=1).reshape(-1)
    return torch.cat([tokens, accepted, drafts])

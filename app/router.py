"""Decode replica choice: conversation affinity first, load when the preferred replica is saturated.

A Ray Serve request router (`ray.serve.request_router.RequestRouter`) running in
each caller of the decode deployment. The ingress puts an affinity key in the
handle's `session_id` (the client's session header, else a hash of the
conversation's opening); the key is ranked over the replicas by rendezvous
hashing, so every router instance agrees on a key's replica without shared state,
and a key moves only when its replica goes away. The preferred replica is the
first rank; Serve's router takes it unless its queue is full
(`max_ongoing_requests`), and then falls to the second rank: two other replicas
picked at random, of which the less loaded wins. Requests without a key use that
second rank directly.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


def affinity_rank(key: str, replica_ids: list[ReplicaID]) -> list[ReplicaID]:
    """Replicas ordered by their rendezvous-hash score for `key`, best first."""

    def score(replica_id: ReplicaID) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica_id.unique_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))


class AffinityRouter(RequestRouter):
    """Routes each key to its rendezvous-hash replica; saturation falls back to the less loaded of two others."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every round offers all candidates, so Serve may back off between rounds when all are full.
            pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key:
            return [_two_random(candidate_replicas)]
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = affinity_rank(key, list(by_id))
        preferred, others = by_id[ranked[0]], [by_id[i] for i in ranked[1:]]
        return [[preferred], _two_random(others)] if others else [[preferred]]

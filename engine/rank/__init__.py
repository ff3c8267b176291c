"""One rank's runner: its model shard, KV pool, attention ops and residency copies.

- `step`: the batch description sent to every rank and what rank 0 returns;
- `worker`: one rank (model shard, KV pool, attention ops);
- `rank_residency`: a rank's page copies and its hot-buffer LRU tables.
"""

"""One rank's runner: its model shard, KV pool, attention ops and residency copies.

- `step`: the batch description sent to every rank and what rank 0 returns;
- `worker`: one rank (model shard, KV pool, attention ops, launching steps);
- `decode_graphs`: decode steps over persistent buffers, captured as CUDA graphs.

A rank's residency mechanism (page copies, hot-buffer tables, resolves) is `residency.rank`.
"""

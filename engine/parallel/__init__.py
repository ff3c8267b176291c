"""Tensor parallelism: one replica's model spread over several ranks.

The driver (the `LLMEngine`'s process) keeps the scheduler, the page
accounting and every residency decision; the ranks hold weight shards and
identical copies of the KV pool and execute what the driver decided. Modules:

- `tensor_parallel`: a rank's place in the group and its one collective;
- `sharding`: which parameter is split along which dimension;
- `step`: the batch description sent to every rank and what rank 0 returns;
- `rank_residency`: a rank's page copies and its hot-buffer LRU tables;
- `worker`: one rank (model shard, KV pool, attention ops);
- `executor`: the interface the engine uses, and the in-process executor;
- `remote`, `mp_executor`, `ray_executor`: ranks in worker processes;
- `shared_memory`: host tensors every rank of a replica maps;
- `placement`: the placement group bundles of a replica.
"""

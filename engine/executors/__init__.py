"""Executors: how the driver's calls reach one replica's ranks.

The driver (the `LLMEngine`'s process) keeps the scheduler, the page accounting
and every residency decision; the ranks hold weight shards and identical copies
of the KV pool and execute what the driver decided. Modules:

- `executor`: the interface the engine uses, and the in-process executor;
- `remote`, `mp_executor`, `ray_executor`: ranks in worker processes or Ray actors;
- `shared_memory`: host tensors every rank of a replica maps;
- `placement`: the placement group bundles of a replica.
"""

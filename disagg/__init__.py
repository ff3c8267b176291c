"""Prefill/decode transfer: the KV export format, the Ray-object host tier, the landing on a decode replica.

A prefill replica turns the cached pages of a computed prompt into a `KVExport`
(`kv_export`), puts it in the Ray object store and hands back a `KVHandle`
(`host_tier`). The decode replica fetches it, checks that it belongs to its
model, layout and prompt, and lands the pages in its own prefix cache
(`landing`), so the request it then admits finds its prefix already computed.
"""

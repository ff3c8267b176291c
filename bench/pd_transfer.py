"""Prefill-to-decode KV transfer through Ray's object store: bytes/s of exports of several sizes.

A sender actor builds a real export (`disagg.kv_export`: the model's page layout,
random page bytes, whole indexer-page groups, as close to each size as groups
allow), puts its Arrow record batch in the object store and hands the reference
on; a receiver actor gets it, reads it as a `KVExport` (on one node a view of the
store's memory) and lands the page bytes with one copy into a tensor on its GPU.
When the host has two GPUs or more each actor holds one, a different one;
otherwise both are CPU-only and the receiver lands into host memory. Timed: the
put (sender), the get and read (receiver), the landing copy (receiver); transfer
GB/s = export bytes / (put + get + land). The receiver's `verify` (token ids,
page hashes) is timed apart: it is on the decode path but
moves no bytes. The ceiling is a host-to-host `copy_` of the same size between
two plain buffers in the receiver, measured in the same run; on one node a
transfer copies every byte twice (into the store, out to the landing), so about
half the ceiling is its natural bound. Each size runs `--repeats` times; the run
of median total time is reported. Prints a table last and writes it, with the
log, under $OUT (or bench/out).

    python bench/pd_transfer.py [--sizes 64MiB,256MiB,1GiB] [--model configs/models/glm-5.3|tiny] [--kv-format fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.ray_workers import runtime_env  # noqa: E402
from bench.timing import OUT_DIR, run_log  # noqa: E402
from disagg.kv_export import KVExport, export_snapshot  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.prefix_transfer import PrefixSnapshot  # noqa: E402
from engine.tiny import TINY_CONFIG  # noqa: E402
from residency.prefix_cache import chain_hashes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "pd-transfer-bench"
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
HEADER = ["size MiB", "pages", "put s", "get s", "land s", "total s", "GB/s", "of memcpy", "verify s"]

log = run_log("pd_transfer")


def parse_size(text: str) -> int:
    """'64MiB' / '1GB' -> bytes (binary units either way)."""
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            return round(float(text[: -len(unit)]) * scale)
    return int(text)


def make_layout(model: str, kv_format: str) -> KVLayout:
    """The page layout of a model config folder, or of the tiny test model for `tiny`."""
    cfg = ModelConfig.from_dict({"vocab_size": 448, **TINY_CONFIG}) if model == "tiny" else ModelConfig.from_dir(model)
    return KVLayout.for_model(cfg, kv_format)


def device_summary() -> str:
    """The calling actor's device and torch threads."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{name}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, {torch.get_num_threads()} threads"


def make_snapshot(layout: KVLayout, num_groups: int) -> tuple[PrefixSnapshot, list[int]]:
    """Random pages of `num_groups` indexer-page groups in one block, as a prefill replica's snapshot has them."""
    per_group = layout.indexer_tokens_per_page // layout.page_size
    num_mla = num_groups * per_group
    gen = torch.Generator().manual_seed(num_groups)
    pages = torch.randint(0, 256, (num_mla + num_groups, layout.page_bytes), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 150_000, (num_mla * layout.page_size,), generator=gen).tolist()
    snap = PrefixSnapshot(len(ids), chain_hashes(ids, layout.page_size), pages[:num_mla], pages[num_mla:])
    return snap, ids


@ray.remote(num_cpus=1)
class Sender:
    """Stands for a prefill replica: holds the snapshot of one size at a time and publishes its export."""

    def __init__(self, model: str, kv_format: str) -> None:
        self.layout = make_layout(model, kv_format)
        self._snapshots: dict[int, tuple[PrefixSnapshot, list[int]]] = {}

    def describe(self) -> str:
        return device_summary()

    def publish(self, num_groups: int) -> tuple[list[ray.ObjectRef], list[int], float]:
        """Puts an export of `num_groups` groups; returns its reference (in a list, so Ray passes it on
        unresolved), the prompt and the seconds `ray.put` took."""
        if num_groups not in self._snapshots:
            self._snapshots = {num_groups: make_snapshot(self.layout, num_groups)}
        snap, ids = self._snapshots[num_groups]
        export = export_snapshot(snap, MODEL_ID, self.layout, ids, 0)
        start = time.perf_counter()
        ref = ray.put(export.batch)
        return [ref], ids, time.perf_counter() - start


@ray.remote(num_cpus=1)
class Receiver:
    """Stands for a decode replica: reads exports and lands their pages with one copy."""

    def __init__(self, model: str, kv_format: str) -> None:
        self.layout = make_layout(model, kv_format)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._landing = torch.empty(0, dtype=torch.uint8)

    def describe(self) -> str:
        return device_summary()

    def land(self, refs: list[ray.ObjectRef], ids: list[int]) -> dict[str, float]:
        """Gets and lands one export; returns the seconds of each phase."""
        start = time.perf_counter()
        export = KVExport(ray.get(refs[0]))
        got = time.perf_counter()
        if self._landing.shape != (export.num_pages, self.layout.page_bytes):
            self._landing = torch.empty(export.num_pages, self.layout.page_bytes, dtype=torch.uint8, device=self.device)
        landed = time.perf_counter()
        self._landing[: export.mla.shape[0]].copy_(export.mla)
        self._landing[export.mla.shape[0] :].copy_(export.indexer)
        if self.device == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        export.verify(MODEL_ID, self.layout, ids)
        verified = time.perf_counter()
        first, last = self._landing[0].cpu(), self._landing[-1].cpu()
        if not (torch.equal(first, export.mla[0]) and torch.equal(last, export.indexer[-1])):
            raise AssertionError("landed bytes differ from the export's")
        return {"get_s": got - start, "land_s": done - landed, "verify_s": verified - done}

    def memcpy_gbs(self, num_bytes: int, repeats: int) -> float:
        """Host-to-host copy GB/s of `num_bytes` between two plain buffers, median of `repeats`."""
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        dst.copy_(src)  # first touch of every page outside the timing
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return num_bytes / statistics.median(times) / 1e9


def measure(sender: ray.actor.ActorHandle, receiver: ray.actor.ActorHandle, num_groups: int) -> dict[str, float]:
    """One transfer of an export of `num_groups` groups, its phases in seconds."""
    refs, ids, put_s = ray.get(sender.publish.remote(num_groups))
    phases = ray.get(receiver.land.remote(refs, ids))
    del refs  # the last reference: the store frees the export
    return {"put_s": put_s, **phases, "total_s": put_s + phases["get_s"] + phases["land_s"]}


def cells(row: dict) -> list[str]:
    return [f"{row['bytes'] / 2**20:.1f}", str(row["pages"]), f"{row['put_s']:.4f}", f"{row['get_s']:.4f}",
            f"{row['land_s']:.4f}", f"{row['total_s']:.4f}", f"{row['gbs']:.2f}", f"{100 * row['share']:.0f}%",
            f"{row['verify_s']:.4f}"]


def fmt_row(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64MiB,256MiB,1GiB", help="comma-separated export sizes (KiB, MiB, GiB)")
    ap.add_argument("--model", default=str(ROOT / "configs/models/glm-5.3"), help="model config folder, or 'tiny'")
    ap.add_argument("--kv-format", default="fp8", choices=["fp8", "bf16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "pd_transfer.log").write_text("")
    layout = make_layout(args.model, args.kv_format)
    group_bytes = (layout.indexer_tokens_per_page // layout.page_size + 1) * layout.page_bytes
    groups = [max(1, round(parse_size(s) / group_bytes)) for s in args.sizes.split(",")]
    num_gpus = 1 if torch.cuda.device_count() >= 2 else 0
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
    start = time.time()
    sender = Sender.options(num_gpus=num_gpus).remote(args.model, args.kv_format)
    receiver = Receiver.options(num_gpus=num_gpus).remote(args.model, args.kv_format)
    log(f"layout {args.model} {args.kv_format}: page {layout.page_bytes} B, group {group_bytes} B; "
        f"sender {ray.get(sender.describe.remote())}; receiver {ray.get(receiver.describe.remote())}; "
        f"object store {ray.available_resources().get('object_store_memory', 0) / 2**30:.1f} GiB")
    measure(sender, receiver, min(groups))  # untimed: actors import, store and landing buffers warm up
    rows = []
    for num_groups in groups:
        num_bytes = num_groups * group_bytes
        memcpy = ray.get(receiver.memcpy_gbs.remote(num_bytes, args.repeats))
        runs = [measure(sender, receiver, num_groups) for _ in range(args.repeats)]
        for run in runs:
            log(f"{num_bytes / 2**20:.1f} MiB: " + ", ".join(f"{k} {v:.4f}" for k, v in run.items()))
        run = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
        gbs = num_bytes / run["total_s"] / 1e9
        rows.append(dict(run, bytes=num_bytes, pages=num_groups * (group_bytes // layout.page_bytes),
                         gbs=gbs, memcpy_gbs=memcpy, share=gbs / memcpy))
        log(f"{num_bytes / 2**20:.1f} MiB: host memcpy {memcpy:.2f} GB/s, transfer {gbs:.2f} GB/s")
    ray.shutdown()
    table = [f"P/D transfer through the object store ({'GPU to GPU' if num_gpus else 'CPU actors'}), "
             f"{layout.page_bytes} B pages; host memcpy ceiling in this run: "
             + ", ".join(f"{r['memcpy_gbs']:.2f}" for r in rows) + f" GB/s; {time.time() - start:.0f} s",
             "", fmt_row(HEADER), fmt_row(["---"] * len(HEADER))] + [fmt_row(cells(r)) for r in rows]
    print("\n".join(table), flush=True)
    (OUT_DIR / "pd_transfer.md").write_text("\n".join(table) + "\n")
    (OUT_DIR / "pd_transfer.json").write_text(json.dumps(dict(model=args.model, kv_format=args.kv_format,
                                                              rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Results of the agent benchmark over HTTP (bench/agent_http.py): the Parquet files, the two plots, the table.

Two files in one folder: agent_http_levels.parquet, one row per (label, concurrency) level, and
agent_http_turns.parquet, one row per turn as it ran. A run merges its rows into them, replacing
rows of its own label and levels and keeping the others, so runs against servers with different
residency policies (`--label hybrid`, `--label offload`) end up side by side; the plots are redrawn
from every label in the file. Read by the harness after a run and by notebooks/agent_benchmark.ipynb;
figures are built without pyplot, so saving them needs no display and leaves pyplot's state alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.figure import Figure

LEVELS_FILE, TURNS_FILE = "agent_http_levels.parquet", "agent_http_turns.parquet"
PLOT_FILES = ("agent_http_interactivity.png", "agent_http_running.png")


def merge_rows(existing: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Existing rows with those of the same (label, concurrency) as a new row replaced by the new rows."""
    replaced = {(r["label"], r["concurrency"]) for r in new}
    return [r for r in existing if (r["label"], r["concurrency"]) not in replaced] + new


def write_merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merges `rows` into the Parquet file at `path`; returns all its rows."""
    existing = pq.read_table(path).to_pylist() if path.exists() else []
    merged = merge_rows(existing, rows)
    columns = dict.fromkeys(key for row in merged for key in row)  # every row's columns: versions may differ
    pq.write_table(pa.Table.from_pydict({key: [row.get(key) for row in merged] for key in columns}), path)
    return merged


def _by_label(levels: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(levels, key=lambda r: (r["label"], r["concurrency"])):
        out.setdefault(row["label"], []).append(row)
    return out


def interactivity_figure(levels: list[dict[str, Any]]) -> Figure:
    """Throughput per GPU against interactivity, one line per label, points labelled by concurrency."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for label, rows in _by_label(levels).items():
        xs, ys = [r["interactivity_tok_s_user"] for r in rows], [r["throughput_tok_s_gpu"] for r in rows]
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="interactivity (tok/s per user)", ylabel="throughput per GPU (tok/s)",
           title="agent workload over HTTP (points: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def running_figure(levels: list[dict[str, Any]]) -> Figure:
    """Mean running requests (from the server's metric) against the client's concurrency."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for label, rows in _by_label(levels).items():
        ax.plot([r["concurrency"] for r in rows], [r["mean_running"] for r in rows], marker="o", label=label)
    ax.set(xlabel="concurrent conversations", ylabel="mean running requests", title="requests the server runs at once")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def format_table(levels: list[dict[str, Any]]) -> str:
    """One line per label and level: the figures of the plots plus latency, errors and the cached share."""
    head = (f"{'label':<12} {'conc':>4} {'reqs':>5} {'err':>4} {'running':>8} {'TTFT50 s':>9} {'TTFT99 s':>9} "
            f"{'TPOT ms':>8} {'tok/s/user':>10} {'tok/s/GPU':>10} {'out/s/GPU':>10} {'cached%':>8}")
    lines = [head]
    for rows in _by_label(levels).values():
        for r in rows:
            cached = 100 * r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else math.nan
            lines.append(
                f"{r['label']:<12} {r['concurrency']:>4} {r['requests']:>5} {r['errors']:>4} {r['mean_running']:>8.2f} "
                f"{r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f} {r['tpot_mean_ms']:>8.1f} "
                f"{r['interactivity_tok_s_user']:>10.1f} {r['throughput_tok_s_gpu']:>10.1f} "
                f"{r['output_tok_s_gpu']:>10.1f} {cached:>8.1f}")
    return "\n".join(lines)


def write_results(out: Path, levels: list[dict[str, Any]], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merges a run's rows into the results files and redraws both plots from every label; returns all level rows."""
    out.mkdir(parents=True, exist_ok=True)
    merged = write_merged(out / LEVELS_FILE, levels)
    write_merged(out / TURNS_FILE, turns)
    for figure, name in zip((interactivity_figure(merged), running_figure(merged)), PLOT_FILES):
        figure.savefig(out / name, dpi=120)
    return merged

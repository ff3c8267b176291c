"""The engine CLI as users and acceptance checks drive it (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cli import _submit, build_parser
from tests.helpers import make_engine


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_generate_requests_file_batches_and_reports(tiny_dir: Path, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    lines = [
        {"prompt": "The tool call returned", "max_tokens": 5},
        {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0.8, "seed": 7},
        {"prompt": ""},
        {"prompt_token_ids": [5, 6], "temperature": -1},
        [1, 2, 3],  # a line that is no request object
        {"prompt_token_ids": [5, 6], "temperature": None},
        {"prompt_token_ids": [5, 6], "stop_token_ids": 5},
    ]
    requests.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = run_cli("generate", "--model", str(tiny_dir), "--requests", str(requests), "--max-tokens", "4",
                   "--json", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert len(out) == 8
    assert len(out[0]["token_ids"]) == 5 and isinstance(out[0]["text"], str)
    assert len(out[1]["token_ids"]) == 3
    assert "empty" in out[2]["error"] and "temperature" in out[3]["error"]
    assert "JSON object" in out[4]["error"] and "wrong type" in out[5]["error"] and "wrong type" in out[6]["error"]
    stats = out[7]["stats"]
    assert stats["pages_in_use"] == 0 and stats["preemptions"] == 0
    assert {"prefix_cache_hit_tokens", "pages_free", "num_pages"} <= set(stats)


def test_generate_matches_engine_and_refuses_bad_ids(tiny_dir: Path) -> None:
    proc = run_cli("generate", "--model", str(tiny_dir), "--prompt-token-ids", "10,20,30", "--max-tokens", "6",
                   "--json", "--num-gpu-pages", "16", "--kv-dtype", "fp8")
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout.splitlines()[0])
    assert len(first["token_ids"]) <= 6
    eager = run_cli("generate", "--model", str(tiny_dir), "--prompt-token-ids", "10,20,30", "--max-tokens", "6",
                    "--json", "--num-gpu-pages", "16", "--kv-dtype", "fp8", "--enforce-eager", "--no-async-scheduling")
    assert eager.returncode == 0, eager.stderr
    assert json.loads(eager.stdout.splitlines()[0])["token_ids"] == first["token_ids"]
    drafted = run_cli("generate", "--model", str(tiny_dir), "--prompt-token-ids", "10,20,30", "--max-tokens", "6",
                      "--json", "--num-gpu-pages", "16", "--kv-dtype", "fp8", "--num-speculative-tokens", "2")
    assert drafted.returncode == 0, drafted.stderr
    lines = [json.loads(line) for line in drafted.stdout.splitlines()]
    assert lines[0]["token_ids"] == first["token_ids"]
    stats = lines[-1]["stats"]
    assert stats["spec_decode_num_draft_tokens"] > 0 and "spec_decode_num_accepted_tokens" in stats
    bad = run_cli("generate", "--model", str(tiny_dir), "--prompt-token-ids", "1,2,99999", "--max-tokens", "3",
                  "--json")
    assert bad.returncode == 2
    assert "token ids" in json.loads(bad.stdout.splitlines()[0])["error"]


def test_make_tiny_and_chat(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert run_cli("make-tiny", "--out", str(out), "--seed", "3").returncode == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    proc = subprocess.run([sys.executable, "-m", "engine", "chat", "--model", str(out), "--max-tokens", "5"],
                          input="hello\nand again\n\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("chat with")


def test_user_errors_end_with_a_message_not_a_traceback(tiny_dir: Path, tmp_path: Path) -> None:
    for args in (("generate", "--model", str(tiny_dir), "--requests", str(tmp_path / "missing.jsonl")),
                 ("generate", "--model", str(tmp_path / "no-model"), "--prompt", "hi"),
                 ("make-tiny", "--out", str(tmp_path / "t"), "--config", str(tmp_path / "missing.json")),
                 ("generate", "--model", str(tiny_dir), "--device", "bogus", "--prompt", "hi")):
        proc = run_cli(*args)
        assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_dir: Path) -> None:
    proc = run_cli("generate", "--model", str(tiny_dir), "--device", "cuda", "--prompt", "hi")
    assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_one_stop_string_is_one_stop(tiny_dir: Path) -> None:
    """`"stop": "xyz"` stops at "xyz", as in the API, not at any of its characters."""
    engine = make_engine(tiny_dir)
    args = build_parser().parse_args(["generate", "--model", str(tiny_dir), "--prompt", "unused"])
    rid = _submit(engine, 0, {"prompt_token_ids": [1, 2], "stop": "xyz"}, args)
    assert engine._requests[rid].params.stop == ("xyz",)

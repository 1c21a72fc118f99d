"""The CLI a newcomer runs first, and the README/CI contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.cluster.serve_process import free_port

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_generate_with_no_arguments_answers_on_the_bundled_model():
    """`pdserve generate` (the offline path) must work with no model flags."""
    res = _run("generate", "--device", "cpu", "--max-model-len", "512")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "The capital of France is Paris."
    assert "runner mrv2" in res.stderr and "loading model" in res.stderr


def test_generate_takes_vllms_sizes(smollm_dir):
    """`--max-model-len 0.5k --kv-cache-memory-bytes 64M`: 500 tokens, and as many KV
    blocks as 64 MiB holds in the model's float32 geometry."""
    cfg = json.loads((Path(smollm_dir) / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4
    res = _run("-v", "generate", "--device", "cpu", "--max-model-len", "0.5k",
               "--kv-cache-memory-bytes", "64M", "--max-tokens", "4")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"mrv2 runner: {(64 << 20) // per_block} KV blocks of 16 tokens" in res.stderr
    res = _run("generate", "--max-model-len", "1.5K")
    assert res.returncode == 2 and "a binary suffix (K) takes a whole number" in res.stderr


def test_cli_errors_are_clear_and_nonzero():
    # `serve` binds its port first: a free one, so the flag errors below are what fails.
    port = str(free_port())
    runs = [
        ("generate", "--model", "/no/such/model"),
        ("generate", "--temperature", "-1"),
        ("serve", "--port", port, "--kv-transport", "cuda_ipc", "--device", "cpu"),
        ("serve", "--port", port, "--mode", "pd", "--runner", "reference"),
        ("serve", "--port", port, "--no-enable-chunked-prefill", "--max-num-batched-tokens",
         "1k", "--max-model-len", "2k"),
        ("serve", "--port", port, "--max-num-batched-tokens", "32"),  # 64 slots
        ("serve", "--port", port, "--device", "cpu", "--kv-cache-memory-bytes", "1000G"),
        ("--help",),
    ]  # fmt: skip
    # Each start imports torch and reads the model's config (~2-7 s): run them at once.
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda args: _run(*args), runs))
    res = iter(results)
    r = next(res)
    assert r.returncode == 2 and "unknown model '/no/such/model'" in r.stderr
    r = next(res)
    assert r.returncode == 2 and "temperature must be >= 0" in r.stderr
    r = next(res)
    assert r.returncode == 2 and "--kv-transport cuda_ipc needs the workers on a GPU" in r.stderr
    r = next(res)
    assert r.returncode == 2 and "--mode pd moves paged KV blocks" in r.stderr
    r = next(res)
    assert r.returncode == 2 and "max_num_batched_tokens must be >= max_model_len" in r.stderr
    assert "Ray" not in r.stderr  # refused before Ray starts
    r = next(res)
    assert r.returncode == 2 and "(32) must be >= --max-num-seqs (64)" in r.stderr
    r = next(res)
    assert r.returncode == 2, r.stderr
    assert "2 CPU worker(s) need 2000.0 GiB of KV cache" in r.stderr, r.stderr
    assert "Ray" not in r.stderr and "starting" not in r.stderr  # refused before Ray
    r = next(res)
    assert r.returncode == 0 and "generate" in r.stdout


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", setup, re.S)
    assert len(commands) == 2, "exactly two set-up commands"
    # The main job is the server on the embedded default (tests/test_serve_e2e.py starts
    # it with no flags but a free port).
    assert commands[0].strip().endswith("pdserve serve")
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci, ".ci/run must run the README's test command verbatim"

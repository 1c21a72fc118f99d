"""The CLI a newcomer runs first, and the README/CI contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cli_in_process import cli_main

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
    # Through the real entry point, as a shell runs it: its exit status and streams.
    with ThreadPoolExecutor(max_workers=2) as pool:
        bad, help_ = pool.map(lambda args: _run(*args), [("generate", "--temperature", "-1"),
                                                         ("--help",)])  # fmt: skip
    assert bad.returncode == 2 and "temperature must be >= 0" in bad.stderr
    assert help_.returncode == 0 and "generate" in help_.stdout
    # The rest in this process. `serve` binds its port first: a free one, so the flag
    # errors below are what fails.
    port = str(free_port())
    code, err = cli_main("generate", "--model", "/no/such/model")
    assert code == 2 and "unknown model '/no/such/model'" in err
    code, err = cli_main("serve", "--port", port, "--kv-transport", "cuda_ipc", "--device", "cpu")
    assert code == 2 and "--kv-transport cuda_ipc needs the workers on a GPU" in err
    code, err = cli_main("serve", "--port", port, "--mode", "pd", "--runner", "reference")
    assert code == 2 and "--mode pd moves paged KV blocks" in err
    code, err = cli_main("serve", "--port", port, "--no-enable-chunked-prefill",
                      "--max-num-batched-tokens", "1k", "--max-model-len", "2k")  # fmt: skip
    assert code == 2 and "max_num_batched_tokens must be >= max_model_len" in err
    assert "Ray" not in err  # refused before Ray starts
    code, err = cli_main("serve", "--port", port, "--max-num-batched-tokens", "32")  # 64 slots
    assert code == 2 and "(32) must be >= --max-num-seqs (64)" in err
    code, err = cli_main("serve", "--port", port, "--device", "cpu", "--kv-cache-memory-bytes",
                      "1000G")  # fmt: skip
    assert code == 2, err
    assert "2 CPU worker(s) need 2000.0 GiB of KV cache" in err, err
    assert "Ray" not in err and "starting" not in err  # refused before Ray
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a refused start left Ray running"


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

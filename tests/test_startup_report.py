"""Each worker's startup line in the serve log (cluster/startup_report.py)."""

from __future__ import annotations

from pdserve.cluster.startup_report import StartupLines, format_startup

GPU = {
    "seconds": {"engine": 16.23, "warm-up": 4.81, "transfer set-up": 0.41},
    "weights_bytes": 3 * 2**29,
    "kv_tokens": 1_093_408,
    "max_model_len": 4096,
    "kv_bytes": 117 * 2**30,
    "cuda_graphs": 36,
    "graph_capture_s": 5.1,
    "graph_bytes": 2**28,
}
CPU = {
    "seconds": {"engine": 6.2, "transfer set-up": 0.01},
    "weights_bytes": 2**28,
    "kv_tokens": 11_264,
    "max_model_len": 8192,
    "kv_bytes": 2**29,
}


def test_the_line_says_time_by_phase_memory_kv_room_and_graphs():
    """Guards the numbers an operator reads at start (vLLM's start-up lines, one per
    worker): the total and each phase, weights and KV memory in GiB, KV tokens and how
    many full-length requests they hold, and the CUDA graphs or that there are none."""
    assert format_startup("decode-0", GPU) == (
        "pdserve: decode-0 ready in 21.4 s (engine 16.2, warm-up 4.8, transfer set-up 0.4): "
        "weights 1.50 GiB; KV cache 1,093,408 tokens, 117.00 GiB (room for 266.9 requests "
        "of 4,096 tokens); 36 CUDA graphs in 5.1 s, 0.25 GiB"
    )
    assert format_startup("prefill-1", CPU) == (
        "pdserve: prefill-1 ready in 6.2 s (engine 6.2, transfer set-up 0.0): weights 0.25 "
        "GiB; KV cache 11,264 tokens, 0.50 GiB (room for 1.4 requests of 8,192 tokens); no "
        "CUDA graphs (eager)"
    )
    no_tensor = {k: v for k, v in CPU.items() if k != "kv_bytes"}  # the reference runner
    assert "KV cache 11,264 tokens (room for" in format_startup("decode-0", no_tensor)


def test_each_start_is_announced_once():
    """Guards the serve loop's use: the members polled every interval must not repeat a
    line; a member still starting (no report yet) waits; a restart (new generation) and a
    worker added later get theirs."""
    lines: list[str] = []
    announced = StartupLines(lines.append)
    members = [
        {"worker_id": "decode-0", "generation": 0, "startup": CPU},
        {"worker_id": "decode-1", "generation": 0, "startup": None},
    ]
    announced.update(members)
    announced.update(members)
    assert [x.split(" ready")[0] for x in lines] == ["pdserve: decode-0"]
    members[1]["startup"] = CPU
    members[0] = {"worker_id": "decode-0", "generation": 1, "startup": GPU}
    announced.update(members)
    announced.update(members)
    assert [x.split(" ready")[0] for x in lines] == [
        "pdserve: decode-0", "pdserve: decode-0", "pdserve: decode-1",
    ]  # fmt: skip
    assert lines[1] == format_startup("decode-0", GPU)

"""Flags of `pdserve bench`, `contract` and `run-batch`'s own (no heavy imports: `--help` is
instant)."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id of /v1/models")
    p.add_argument("--dataset", choices=["random", "prefix", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random, prefix)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, with ignore_eos")
    p.add_argument("--prefix-len", type=int, default=None,
                   help="prefix dataset: tokens shared by every prompt (default input-len // 2)")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids are drawn from [1000, vocab-size)")  # fmt: skip
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (default inf: all at once)")  # fmt: skip
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most C requests in flight, sent back to back")  # fmt: skip
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:5000; goodput = req/s meeting all")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the report as JSON")
    p.add_argument("--save-detailed", action="store_true",
                   help="add per-request numbers ('requests') to the JSON")  # fmt: skip
    p.add_argument("--plot", default=None, help="write latency CDFs to this PNG")
    p.add_argument("--api-key", default=None)


def add_contract_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", required=True, help="URL of the deployment in service")
    p.add_argument("--candidate", required=True, help="URL of the deployment to switch to")
    p.add_argument("--cases", default="default", help="default | FILE.yaml (see the runbook)")
    p.add_argument("--api-key", default=None, help="sent to both servers")
    p.add_argument("--only", nargs="+", default=None, metavar="CONTRACT",
                   help="run only these contracts (names as printed)")  # fmt: skip


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    """run-batch's own flags (cluster/run_batch.py leaves them out of the server it starts);
    `serve`'s come beside them."""
    p.add_argument("-i", "--input-file", required=True,
                   help="the batch: one JSON request a line (- for stdin)")  # fmt: skip
    p.add_argument("-o", "--output-file", required=True,
                   help="the answers, one JSON line a request in input order (- for stdout)")  # fmt: skip
    p.add_argument("--base-url", default=None,
                   help="a running server's root; default: start one with the serve flags given")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="requests in flight at once (default 64)")  # fmt: skip

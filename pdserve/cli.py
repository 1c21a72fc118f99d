"""The `pdserve` command line.

    pdserve generate [--model M] [--prompt "..."] [--max-tokens N] [--temperature T]
    pdserve serve [--mode pd|colocated] ...
    pdserve bench --base-url URL --dataset random|prefix|sharegpt --num-prompts N ...
    pdserve contract --baseline URL --candidate URL [--cases default|FILE.yaml]

Heavy imports happen inside the subcommand, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

from pdserve.sizes import size_arg
from pdserve.version import __version__

DEFAULT_PROMPT = "What is the capital of France?"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--max-model-len", type=size_arg, default=None, help="e.g. 4096 or 32k")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=size_arg, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=size_arg, default=None, metavar="SIZE",
                   help="KV cache size, e.g. 1G (default: from --gpu-memory-utilization on a "
                   "GPU, 0.5 GiB on the CPU)")  # fmt: skip
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "mrv2", "reference"],
        help="model runner; auto = mrv2 where supported (env PDSERVE_RUNNER)",
    )
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="complete one prompt offline and print the text",
        description="Complete one prompt with the offline engine.",
    )
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is instead of through the chat template",
    )
    _add_engine_args(gen)
    from pdserve.cluster.serve_flags import add_serve_args

    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API with prefill/decode pools on Ray",
        description="Start a local Ray instance, the worker pools and the HTTP router.",
    )
    add_serve_args(serve)
    from pdserve.cluster.tool_args import add_bench_args, add_contract_args, add_run_batch_args

    bench = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible server and report latency distributions",
        description="Streamed /v1/completions load: TTFT, TPOT, ITL, E2EL, throughput, goodput.",
    )
    add_bench_args(bench)
    contract = sub.add_parser(
        "contract",
        help="check that a candidate server keeps the baseline's output contract",
        description="Run a golden set against two servers; exit 1 if any contract fails.",
    )
    add_contract_args(contract)
    run_batch = sub.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests and write their answers",
        description="vLLM's run-batch: each line of the input is a request (custom_id, method, "
        "url, body); each line of the output its response, in the same order. The requests go "
        "to --base-url, or to a server started with the serve flags given here.",
    )
    add_run_batch_args(run_batch)
    add_serve_args(run_batch)
    return parser


class _Spinner:
    """A one-line progress indication on stderr while something slow runs."""

    def __init__(self, message: str):
        self.message = message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start, frames, i = time.monotonic(), "|/-\\", 0
        while not self._stop.wait(0.2):
            elapsed = time.monotonic() - start
            sys.stderr.write(f"\r{frames[i % 4]} {self.message} ({elapsed:.0f} s)")
            sys.stderr.flush()
            i += 1

    def __enter__(self) -> _Spinner:
        if sys.stderr.isatty():
            self._thread.start()
        else:
            sys.stderr.write(f"{self.message} ...\n")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
            sys.stderr.write("\r\033[K")


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.runner.llm import LLM
    from pdserve.runner.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    with _Spinner("loading model"):
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            runner=args.runner,
            seed=args.seed,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    tok = llm.get_tokenizer()
    use_chat = not args.raw and tok is not None and getattr(tok, "chat_template", None)
    sys.stderr.write(
        f"model {llm.config.model.source} | runner {llm.runner_name} | "
        f"device {llm.config.runner.device}\n"
    )
    if use_chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.serve import run_serve
    from pdserve.cluster.serve_flags import config_from_args

    return run_serve(config_from_args(args))


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from pdserve.cluster.bench import BenchConfig, format_report, plot_cdfs, run_bench

    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, dataset=args.dataset,
        dataset_path=args.dataset_path, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, prefix_len=args.prefix_len, vocab_size=args.vocab_size,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        goodput=tuple(args.goodput or ()), seed=args.seed, api_key=args.api_key,
    )  # fmt: skip
    report, requests = run_bench(cfg)
    if args.result_file:
        out = dict(report, requests=requests) if args.save_detailed else report
        with open(args.result_file, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot_cdfs(requests, args.plot)
    print(format_report(report))
    return 0 if report["completed"] else 1


def cmd_run_batch(args: argparse.Namespace, argv: list[str]) -> int:
    import asyncio
    import tempfile

    from tqdm import tqdm

    from pdserve.cluster.run_batch import (
        read_input,
        run_lines,
        serve_args,
        served_model,
        write_output,
    )
    from pdserve.cluster.serve_flags import config_from_args
    from pdserve.cluster.serve_process import ServeProcess

    lines = read_input(args.input_file)
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    serve_cfg = config_from_args(args)  # checks the serve flags before any start
    api_key = serve_cfg.api_key
    server, url = None, args.base_url
    if url is None and serve_cfg.tls.enabled:
        raise ValueError(
            "run-batch's own server is a child on 127.0.0.1 that only this command calls: "
            "leave out the --ssl-* flags (--base-url https://... sends a batch to a TLS server)"
        )
    if url is None:
        with _Spinner("starting pdserve serve"):
            try:
                server = ServeProcess(Path(tempfile.mkdtemp(prefix="pdserve-batch-")),
                                     *serve_args(argv))  # fmt: skip
            except RuntimeError as e:  # its log says why
                raise ValueError(f"the batch's server did not start: {e}") from None
        sys.stderr.write(f"server log: {server.log}\n")
        url = server.url
    try:
        model = served_model(url, api_key)
        with tqdm(total=len(lines), file=sys.stderr, desc="requests", unit="req") as bar:
            run = run_lines(url, lines, model, api_key, args.max_concurrency, bar)
            outputs = asyncio.run(run)
    finally:
        if server is not None:
            server.stop()
    write_output(args.output_file, outputs)
    ok = sum(1 for o in outputs if o["response"] and o["response"]["status_code"] == 200)
    bad = sum(1 for o in outputs if o["error"] is not None)
    sys.stderr.write(f"{len(outputs)} request(s): {ok} answered, "
                     f"{len(outputs) - ok - bad} refused by the server, {bad} error line(s)\n")  # fmt: skip
    return 0


def cmd_contract(args: argparse.Namespace) -> int:
    from pdserve.cluster.contract import run_contracts

    return run_contracts(args.baseline, args.candidate, args.cases, args.api_key, args.only)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "run-batch":  # it starts `serve` with the serve flags it got
            raw = sys.argv[1:] if argv is None else argv
            return cmd_run_batch(args, raw[raw.index("run-batch") + 1 :])
        commands = {
            "generate": cmd_generate,
            "serve": cmd_serve,
            "bench": cmd_bench,
            "contract": cmd_contract,
        }
        return commands[args.command](args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

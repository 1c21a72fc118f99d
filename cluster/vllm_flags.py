"""`vllm serve` flags that `pdserve serve` does not take, each refused with what pdserve
does instead, and the ones whose meaning pdserve already keeps, taken as vLLM takes them.

An operator's vLLM launch line otherwise stops at argparse's bare "unrecognized
arguments: --swap-space". Here each such flag is known by name: the refusal says why the
knob does not exist in pdserve and which one does the job, and a flag whose meaning
holds in pdserve anyway (`--tokenizer-mode auto`, `--max-log-len`) is accepted so the
line runs unchanged. None of them shows in `--help`; README's configuration lists them.
"""

from __future__ import annotations

import argparse
from typing import Any

# flag (with its short alias, if any) -> (does it take a value, why pdserve has no such
# knob and what it has instead)
NOT_TAKEN: dict[tuple[str, ...], tuple[bool, str]] = {
    ("--swap-space",): (
        True,
        "pdserve does not swap a preempted request's KV to host memory: "
        "it recomputes it, and prefixes evicted from the GPU go to the KV "
        "tier (config key tier_bytes)",
    ),
    ("--cpu-offload-gb",): (True, "pdserve keeps all weights on the GPU"),
    ("--kv-offloading-size", "--kv-offloading-backend"): (
        True,
        "host-memory KV is the KV tier's (config key tier_bytes)",
    ),
    ("--distributed-executor-backend",): (
        True,
        "pdserve's workers are always Ray actors, one GPU each",
    ),
    ("--disable-custom-all-reduce",): (
        False,
        "a pdserve worker runs on one GPU (tensor parallel size 1): there is no all-reduce",
    ),
    ("--enable-expert-parallel",): (False, "a pdserve worker runs on one GPU"),
    ("-dp", "--data-parallel-size"): (
        True,
        "pdserve's data parallelism is its pools: --decode-workers and "
        "--prefill-workers (or --autoscale)",
    ),
    ("-O", "--compilation-config"): (
        True,
        "pdserve does not use torch.compile: decode steps run as CUDA graphs "
        "(--cuda-graph-sizes, --enforce-eager)",
    ),
    ("--max-seq-len-to-capture",): (
        True,
        "a decode step's CUDA graph does not depend on the sequence length; "
        "--cuda-graph-sizes sets the batch sizes captured",
    ),
    ("--model-impl",): (
        True,
        "pdserve runs its own implementation of each architecture it serves "
        "(--runner reference runs transformers' model instead)",
    ),
    ("--kv-transfer-config",): (
        True,
        "prefill/decode disaggregation is built in: --mode pd, --kv-transport",
    ),
    ("--preemption-mode",): (True, "pdserve preempts by recomputing only"),
    (
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--long-prefill-token-threshold",
    ): (True, "a step's prompt tokens are bounded by --max-num-batched-tokens alone"),
    ("--enable-sleep-mode",): (False, "pdserve workers have no sleep mode"),
    ("--disable-cascade-attn",): (False, "pdserve has no cascade attention to turn off"),
    ("--otlp-traces-endpoint", "--collect-detailed-traces"): (
        True,
        "pdserve exports no OpenTelemetry traces: each request's route and timings are "
        "in the log (--enable-log-requests) and /metrics",
    ),
    ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs"): (
        True,
        "pdserve serves plain HTTP: terminate TLS in front of it (an ingress or a proxy)",
    ),
}

# Flags whose meaning pdserve keeps without a setting: flag -> (its values, why it holds)
HOLDS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "--tokenizer-mode": (
        ("auto", "hf"),
        "pdserve loads tokenizers as transformers' AutoTokenizer does (a fast tokenizer "
        "where the checkpoint has one), which is vLLM's auto",
    ),
    "--max-log-len": (None, "pdserve's request log prints token counts, never prompt text"),
}


class _NotTaken(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any):
        super().__init__(option_strings, dest, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is a vLLM flag pdserve does not take: {self.reason}")


class _Holds(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, values_ok=None, **kw: Any):
        super().__init__(option_strings, dest, **kw)
        self.values_ok = values_ok

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.values_ok is not None and values not in self.values_ok:
            parser.error(
                f"{option_string} {values}: pdserve takes {' or '.join(self.values_ok)} only "
                f"({HOLDS[option_string][1]})"
            )
        if self.values_ok is None and not values.isdigit():
            parser.error(f"{option_string} must be a number of characters (got {values!r})")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Adds the flags above to `pdserve serve`'s parser, out of its help."""
    for flags, (takes_value, reason) in NOT_TAKEN.items():
        p.add_argument(*flags, action=_NotTaken, reason=reason, nargs=None if takes_value else 0,
                       dest=f"_vllm_{flags[-1].lstrip('-')}", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)  # fmt: skip
    for flag, (values_ok, _) in HOLDS.items():
        p.add_argument(flag, action=_Holds, values_ok=values_ok, dest=f"_vllm_{flag.lstrip('-')}",
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip

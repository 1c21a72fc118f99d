"""`vllm serve` flags that have no knob in `pdserve serve`: taken where their meaning holds
here anyway (`-dp 1`, `--tokenizer-mode auto`), refused otherwise with why and what to use.

An operator's vLLM launch line otherwise stops at argparse's bare "unrecognized
arguments: --swap-space". Here each such flag is known by name: a value that means what
pdserve does anyway is taken (the line runs unchanged), any other stops the start with
the reason and the knob that does the job. None of them shows in `--help`; README's
configuration lists them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

INT = "an integer"  # `holds`: any integer >= 0 (a flag with no setting here)


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # the flag and its short alias, if any
    why: str  # what pdserve does instead
    # What holds here: a boolean flag's True (False: the flag is refused); a value flag's
    # values (a tuple, or INT for any integer >= 0; None: the flag is refused).
    holds: tuple[str, ...] | str | bool | None = None

    @property
    def takes_value(self) -> bool:
        return not isinstance(self.holds, bool)


FLAGS = (
    VllmFlag(("--tokenizer-mode",), "tokenizers load as transformers' AutoTokenizer loads "
             "them (a fast tokenizer where the checkpoint has one)", ("auto", "hf")),
    VllmFlag(("--max-log-len",), "the request log prints token counts, never prompt text", INT),
    VllmFlag(("--max-seq-len-to-capture",), "a decode step's CUDA graph serves any sequence "
             "length; --cuda-graph-sizes sets the batch sizes captured", INT),
    VllmFlag(("-dp", "--data-parallel-size"), "pdserve's data parallelism is its pools: "
             "--decode-workers and --prefill-workers (or --autoscale)", ("1",)),
    VllmFlag(("--distributed-executor-backend",), "a pdserve worker is a Ray actor on one GPU",
             ("ray",)),
    VllmFlag(("--disable-custom-all-reduce",), "a pdserve worker runs on one GPU: no "
             "all-reduce runs", True),
    VllmFlag(("--enable-expert-parallel",), "a pdserve worker holds all of a layer's experts "
             "on its one GPU", True),
    VllmFlag(("--disable-cascade-attn",), "pdserve has no cascade attention", True),
    VllmFlag(("--cpu-offload-gb",), "pdserve keeps all weights on the GPU", ("0",)),
    VllmFlag(("-O", "--compilation-config"), "pdserve does not use torch.compile: decode "
             "steps run as CUDA graphs (--cuda-graph-sizes, --enforce-eager)", ("0",)),
    VllmFlag(("--model-impl",), "pdserve runs its own implementation of each architecture "
             "it serves (--runner reference runs transformers' model instead)", ("auto",)),
    VllmFlag(("--preemption-mode",), "pdserve preempts by recomputing", ("recompute",)),
    VllmFlag(("--swap-space",), "pdserve does not swap a preempted request's KV to host "
             "memory: it recomputes it, and prefixes evicted from the GPU go to the KV tier "
             "(config key tier_bytes)"),
    VllmFlag(("--kv-offloading-size", "--kv-offloading-backend"), "host-memory KV is the "
             "KV tier's (config key tier_bytes)"),
    VllmFlag(("--kv-transfer-config",), "prefill/decode disaggregation is built in: --mode "
             "pd, --kv-transport"),
    VllmFlag(("--max-num-partial-prefills", "--max-long-partial-prefills",
              "--long-prefill-token-threshold"), "a step's prompt tokens are bounded by "
             "--max-num-batched-tokens alone"),
    VllmFlag(("--enable-sleep-mode",), "pdserve workers have no sleep mode", False),
    VllmFlag(("--otlp-traces-endpoint", "--collect-detailed-traces"), "pdserve exports no "
             "OpenTelemetry traces: each request's route and timings are in the log "
             "(--enable-log-requests) and /metrics"),
    VllmFlag(("--enable-request-id-headers",), "every pdserve response carries X-Request-Id "
             "(the client's, or one made for it)", True),
    VllmFlag(("--api-server-count", "-asc"), "pdserve's router is one process per head",
             ("1",)),
    VllmFlag(("--disable-frontend-multiprocessing",), "pdserve's engines run in their Ray "
             "workers, apart from the router, either way", True),
    VllmFlag(("--config-format",), "pdserve reads the checkpoint's transformers "
             "config.json", ("auto", "hf")),
    VllmFlag(("--stream-interval",), "pdserve streams each step's tokens as they come", ("1",)),
    VllmFlag(("--hf-token",), "set HF_TOKEN in the environment of every node instead: "
             "huggingface_hub reads it wherever a worker downloads the model"),
    VllmFlag(("--middleware", "--tool-parser-plugin"), "pdserve loads no code named on its "
             "command line (its parsers: --tool-call-parser, --reasoning-parser)"),
    VllmFlag(("--uds",), "pdserve listens on --host and --port"),
    VllmFlag(("--enable-log-outputs",), "the request log prints token counts, never text "
             "(--enable-log-requests)", False),
    VllmFlag(("--kv-events-config",), "pdserve publishes no KV cache events: /metrics and "
             "/ops/pools report each worker's cache"),
    VllmFlag(("--enable-prompt-embeds", "--skip-tokenizer-init"), "pdserve takes prompts as "
             "text or token ids and detokenizes every reply", False),
    VllmFlag(("--enable-ssl-refresh",), "pdserve loads its certificate files once: restart "
             "the router to load new ones", False),
)  # fmt: skip


class _Action(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, flag: VllmFlag, **kw: Any):
        super().__init__(option_strings, dest, **kw)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        holds, why = self.flag.holds, self.flag.why
        if holds is None or holds is False:
            parser.error(f"{option_string} is a vLLM flag pdserve does not take: {why}")
        if holds == INT and not values.isdigit():
            parser.error(f"{option_string} must be an integer >= 0 (got {values!r}): {why}")
        if isinstance(holds, tuple) and values not in holds:
            parser.error(
                f"{option_string} {values}: pdserve takes {' or '.join(holds)} only: {why}"
            )


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Adds the flags above to `pdserve serve`'s parser, out of its help."""
    for flag in FLAGS:
        # A refused value flag is refused with or without its value (vLLM's --hf-token
        # may come alone).
        nargs = "?" if flag.holds is None else None if flag.takes_value else 0
        p.add_argument(*flag.names, action=_Action, flag=flag, nargs=nargs,
                       dest=f"_vllm_{flag.names[-1].lstrip('-')}", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)  # fmt: skip

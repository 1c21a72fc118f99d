"""An engine's token grammars, compiled once per distinct constraint and kept a while.

Requests with the same schema (the usual case: one application, one schema) share one
table. A new constraint is parsed when its first request is validated, on the engine's loop
(well under a millisecond; a bad regex or an unsupported schema keyword fails there, before
anything is queued). Its byte DFA (up to ~0.2 s for a schema with long strings) and token
table (JSON mode: ~0.9 s on the H200's host, ~3 s on 2 CPU cores) are built on a thread of
their own, so the engine keeps stepping the other requests meanwhile and admits the waiting
ones once it is done (`Engine._admit_compiled`); a DFA that fails (too many states, or no
string matches) ends its requests with an error. The router and `LLM.generate` compile the
DFA before they queue a request, so their callers get that error up front.
At most `max_entries` stay; the least recently used goes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdserve.runner.structured.patterns import compile_spec, grammar_depth, pattern_node
from pdserve.runner.structured.spec import StructuredOutputs
from pdserve.runner.structured.token_bytes import token_byte_strings
from pdserve.runner.structured.token_table import TokenGrammar, build_token_grammar

logger = logging.getLogger(__name__)


class GrammarCache:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        device: torch.device,
        max_entries: int = 32,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = frozenset(eos_ids)
        self._device = device
        self._max_entries = max_entries
        self._token_bytes: list[bytes | None] | None = None
        self._lock = threading.Lock()  # the cache and counters, shared with the builder
        self._grammars: OrderedDict[str, TokenGrammar] = OrderedDict()
        self._building: dict[str, Future[TokenGrammar]] = {}
        # One builder thread: constraints compile one after another, beside the steps.
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-build")
        # For /metrics: requests that took a grammar, compiles, and their seconds.
        self.requests = 0
        self.compiles = 0
        self.compile_seconds = 0.0

    def reset_counters(self) -> None:
        with self._lock:
            self.requests = self.compiles = 0
            self.compile_seconds = 0.0

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError if the spec does not parse or there is no tokenizer (its DFA and token
        table are left to `prepare`'s thread)."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model directory has none")
        pattern_node(spec)

    def prepare(self, spec: StructuredOutputs) -> Future[TokenGrammar]:
        """The spec's grammar for a request being queued: a done future when cached, else
        the build under way (started here if it is the first request to ask)."""
        key = spec.key
        with self._lock:
            self.requests += 1
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                done: Future[TokenGrammar] = Future()
                done.set_result(grammar)
                return done
            future = self._building.get(key)
            if future is None:
                future = self._building[key] = self._builder.submit(self._build, spec)
            return future

    def get(self, spec: StructuredOutputs, timeout_s: float = 600.0) -> TokenGrammar:
        """The spec's grammar, built now if needed (tests and tools; the engine uses
        `prepare`)."""
        self.check(spec)
        compile_spec(spec)  # its errors raise here, not from the builder's future
        return self.prepare(spec).result(timeout_s)

    def _build(self, spec: StructuredOutputs) -> TokenGrammar:
        key = spec.key
        try:
            start = time.perf_counter()
            dfa = compile_spec(spec)
            if self._token_bytes is None:
                self._token_bytes = token_byte_strings(self._tokenizer, self._vocab_size)
            grammar = build_token_grammar(dfa, self._token_bytes, self._eos_ids, self._device)
            seconds = time.perf_counter() - start
            depth = grammar_depth(spec)
            logger.info(
                "structured output (%s): %d states, %d token classes, %.1f MB, compiled in "
                "%.2f s beside the steps",
                spec.describe() if depth is None else f"grammar, recursion {depth} deep",
                dfa.num_states, grammar.table.shape[1], grammar.nbytes() / 1e6, seconds,
            )  # fmt: skip
            with self._lock:
                self.compiles += 1
                self.compile_seconds += seconds
                self._grammars[key] = grammar
                while len(self._grammars) > self._max_entries:
                    self._grammars.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                self._building.pop(key, None)

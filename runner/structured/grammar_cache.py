"""An engine's token grammars, compiled once per distinct constraint and kept a while.

Requests with the same schema (the usual case: one application, one schema) share one
table. The first request of a new constraint pays for its compile on the engine's loop
(logged with its time and size); bad constraints fail there too, before anything is
queued. At most `max_entries` stay; the least recently used goes first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from pdserve.runner.structured.patterns import compile_spec
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
        self._grammars: OrderedDict[str, TokenGrammar] = OrderedDict()
        # For /metrics: requests that took a grammar, compiles, and their seconds.
        self.requests = 0
        self.compiles = 0
        self.compile_seconds = 0.0

    def reset_counters(self) -> None:
        self.requests = self.compiles = 0
        self.compile_seconds = 0.0

    def get(self, spec: StructuredOutputs, for_request: bool = False) -> TokenGrammar:
        """The spec's grammar; ValueError if the spec is bad or there is no tokenizer.
        `for_request`: a request is queued with it (counted; a validation is not)."""
        self.requests += for_request
        key = spec.key
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        if self._tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model directory has none")
        start = time.perf_counter()
        dfa = compile_spec(spec)
        if self._token_bytes is None:
            self._token_bytes = token_byte_strings(self._tokenizer, self._vocab_size)
        grammar = build_token_grammar(dfa, self._token_bytes, self._eos_ids, self._device)
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - start
        logger.info(
            "structured output (%s): %d states, %d token classes, %.1f MB, compiled in %.2f s",
            spec.describe(),
            dfa.num_states,
            grammar.table.shape[1],
            grammar.nbytes() / 1e6,
            time.perf_counter() - start,
        )
        self._grammars[key] = grammar
        while len(self._grammars) > self._max_entries:
            self._grammars.popitem(last=False)
        return grammar

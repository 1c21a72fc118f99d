"""What the scheduler hands the runner each step: the typed contract between the two.

Rows of the batch are the keys of `num_scheduled_tokens`, in insertion order (the
scheduler puts decodes first). A runner never sees a request's full history again after
it was added: per step it gets only new block ids and the computed-token count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runner.kv_hooks import KVLoadSpec
from pdserve.runner.pooling import PoolingSpec
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.token_table import TokenGrammar


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + tokens generated so far (a resumed request re-prefills all)
    num_prompt_tokens: int  # original prompt length: penalties and min_tokens count after it
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...] = ()  # EOS + stop_token_ids, suppressed until min_tokens
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    grammar: TokenGrammar | None = None  # structured output: what the output must follow
    lora_name: str | None = None  # the LoRA adapter it runs with (runner/lora/)
    pooling: PoolingSpec | None = None  # an embedding request: how its prompt is pooled
    state_unit: int | None = None  # a hybrid Mamba model's: its state unit (state_pool.py)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step's tokens
    # Set in the step after one with draft tokens: the tokens the request has now. The
    # runner counted every draft as kept; the rejected ones' places are free again.
    num_tokens: int | None = None


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # batch order
    finished_req_ids: set[str] = field(default_factory=set)  # free these slots first
    kv_loads: list[KVLoadSpec] = field(default_factory=list)  # decode role: start these loads
    # A hybrid's state-unit copies (source, target), done in order before the step runs:
    # prefix-caching snapshots saved and restored (runner/state_snapshots.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding (runner/speculative/): req_id -> its draft tokens, scheduled
    # after its last token (their count is in `num_scheduled_tokens`)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

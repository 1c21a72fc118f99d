"""A byte DFA lifted to tokens: for every automaton state, where each token id leads.

Sampling under a grammar needs, each step, the tokens allowed from a row's state and,
once one is sampled, the row's next state. Both come from one table kept on the device,
so a step masks and advances its rows with a few gathers and no host round trip: async
scheduling and the CUDA-graph decode stay as they are for the other rows, and the host
never waits for a sampled token to build the next step's mask.

`next[s, t]` is the state after token t's bytes from state s, -1 where they leave the
language. Tokens whose columns are equal share one column (a token class): of SmolLM2's
49,152 tokens most are words that a JSON automaton treats alike, so the table is
[states + 1, classes] and not [states, vocabulary]. Row `finish` (the last) allows only
EOS: a row whose walk died (it cannot, when every step was masked) or reached a state with
no way on ends there instead of sampling from an all -inf row.

EOS is allowed exactly in accepting states. Special tokens are never allowed.

Building it walks every distinct token spelling (a string of the DFA's byte classes)
from every state at once, as a trie, one depth at a time: states x trie nodes in gathers.
JSON mode (831 states) on SmolLM2's vocabulary: 34k spellings, 69k trie nodes, ~3 s on a
2-core CPU (0.9 s on the H200's host for a 151,936-id model); tests/test_structured_output.py
checks the table against a plain walk of every token from every state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.runner.structured.byte_dfa import ByteDFA


@dataclass(frozen=True)
class TokenGrammar:
    table: torch.Tensor  # [S + 1, C] int32 on the device: next state, -1 = not allowed
    token_class: torch.Tensor  # [V] int64 on the device: each token id's column
    dfa: ByteDFA  # the host walks it to place a resumed request (`state_after`)
    token_bytes: list[bytes | None]  # [V]
    eos_ids: frozenset[int]

    @property
    def finish(self) -> int:
        """The state that allows only EOS."""
        return self.table.shape[0] - 1

    @property
    def start(self) -> int:
        return self.dfa.start

    def state_after(self, output_ids: list[int]) -> int:
        """The state after a request's generated tokens (a request resumed after
        preemption, or a decode worker's request whose first token came from prefill)."""
        state = self.dfa.start
        for t in output_ids:
            if t in self.eos_ids:
                return self.finish
            data = self.token_bytes[t] if 0 <= t < len(self.token_bytes) else None
            state = -1 if data is None else self.dfa.walk(data, state)
            if state < 0:
                return self.finish
        return state

    def nbytes(self) -> int:
        return self.table.numel() * 4 + self.token_class.numel() * 8


def build_token_grammar(
    dfa: ByteDFA, token_bytes: list[bytes | None], eos_ids: frozenset[int], device: torch.device
) -> TokenGrammar:
    num_states = dfa.num_states
    # Bytes the DFA never tells apart share a class; a token's spelling is then a string
    # of classes, and tokens spelled alike (most words, for a JSON automaton) walk alike.
    byte_cols, byte_class = np.unique(dfa.trans.T, axis=0, return_inverse=True)
    byte_class = byte_class.reshape(-1).astype(np.uint8)  # <= 256 classes
    num_classes = byte_cols.shape[0]
    sink = num_states  # walks that left the language stay here
    step = np.full((num_states + 1) * num_classes, sink, dtype=np.int32)  # [S + 1, K] flat
    step[: num_states * num_classes] = np.where(byte_cols.T < 0, sink, byte_cols.T).ravel()

    texts = [(t, b) for t, b in enumerate(token_bytes) if b and t not in eos_ids]
    spelling_ids: dict[bytes, int] = {}
    spelling_of = np.empty(len(texts), dtype=np.int64)
    for i, (_, b) in enumerate(texts):
        key = byte_class[np.frombuffer(b, dtype=np.uint8)].tobytes()
        spelling_of[i] = spelling_ids.setdefault(key, len(spelling_ids))
    num_spellings = len(spelling_ids)
    finish = num_states
    # Rows of `by_column`: the spellings, then EOS, then "never" (special tokens, ids
    # without text); columns: the states, then `finish`. Transposed, so that every copy
    # below moves whole contiguous rows.
    by_column = np.empty((num_spellings + 2, num_states + 1), dtype=np.int32)
    by_column[:num_spellings, :num_states] = _walk_spellings(
        list(spelling_ids), step, num_states, num_classes
    )
    by_column[by_column == sink] = -1
    by_column[:, finish] = -1
    by_column[num_spellings, :num_states] = np.where(dfa.accept, np.arange(num_states), -1)
    by_column[num_spellings, finish] = finish
    by_column[num_spellings + 1] = -1
    # A state with no way on ends the request (see the module note).
    stuck = (by_column[:, :num_states] < 0).all(axis=0)
    by_column[num_spellings, :num_states][stuck] = finish
    distinct, col_class = _unique_rows(by_column)
    table = np.ascontiguousarray(distinct.T)
    token_class = np.full(len(token_bytes), col_class[num_spellings + 1], dtype=np.int64)
    token_class[[t for t, _ in texts]] = col_class[spelling_of]
    for t in eos_ids:
        if 0 <= t < len(token_bytes):
            token_class[t] = col_class[num_spellings]
    return TokenGrammar(
        table=_to_device(table, device),
        token_class=_to_device(token_class, device),
        dfa=dfa,
        token_bytes=token_bytes,
        eos_ids=eos_ids,
    )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """On CUDA through pinned memory, without a host sync: the table is built on a thread
    beside the engine's steps (grammar_cache.py), which must not stall them."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _walk_spellings(
    spellings: list[bytes], step: np.ndarray, num_states: int, num_classes: int
) -> np.ndarray:
    """[len(spellings), S] int32: the state after each spelling from each state (`num_states`
    = left the language). Spellings share prefixes, so they are walked as a trie, one
    depth at a time: each trie node is one gather over the states (SmolLM2's 34k JSON
    spellings are 69k nodes, against 230k bytes walked one spelling at a time)."""
    order = sorted(range(len(spellings)), key=spellings.__getitem__)
    # Trie nodes by depth: (parent's index at depth - 1, class); `ends[d]`: (node index
    # at depth d, spelling) for the spellings ending there.
    parents: list[list[int]] = []
    classes: list[list[int]] = []
    ends: list[list[tuple[int, int]]] = []
    path: list[int] = []  # node index at each depth of the previous spelling
    prev = b""
    for sp in order:
        word = spellings[sp]
        shared = 0
        limit = min(len(word), len(prev))
        while shared < limit and word[shared] == prev[shared]:
            shared += 1
        del path[shared:]
        for d in range(shared, len(word)):
            if d == len(parents):
                parents.append([])
                classes.append([])
                ends.append([])
            parents[d].append(path[d - 1] if d else 0)
            classes[d].append(word[d])
            path.append(len(parents[d]) - 1)
        ends[len(word) - 1].append((path[len(word) - 1], sp))
        prev = word
    out = np.empty((len(spellings), num_states), dtype=np.int32)
    step_t = torch.from_numpy(step)
    levels = [
        (torch.tensor(p, dtype=torch.int64), torch.tensor(c, dtype=torch.int32))
        for p, c in zip(parents, classes)
    ]
    widest = max((len(p) for p in parents), default=1)
    chunk = max(1, (16 << 20) // widest)  # the [nodes, chunk] matrices stay ~64 MB
    for lo in range(0, num_states, chunk):
        hi = min(lo + chunk, num_states)
        cur = torch.arange(lo, hi, dtype=torch.int32)[None, :]
        for d, (parent, cls) in enumerate(levels):
            src = cur if d == 0 else cur[parent]
            cur = step_t[(src * num_classes + cls[:, None]).long()]
            if ends[d]:
                nodes, sps = zip(*ends[d])
                out[list(sps), lo:hi] = cur[list(nodes)].numpy()
    return out


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows, each row's index among them). Rows are hashed (a random linear
    form, wrapping int64, in blocks of rows) and grouped by hash; the grouping is then
    checked against the rows themselves, so a collision cannot merge two tokens silently.
    `np.unique(axis=0)` sorts whole rows: 7 s against ~0.1 s for SmolLM2's JSON mode."""
    weights = np.random.default_rng(0).integers(1, 1 << 62, size=rows.shape[1], dtype=np.int64)
    keys = np.empty(rows.shape[0], dtype=np.int64)
    block = max(1, (4 << 20) // max(rows.shape[1], 1))
    with np.errstate(over="ignore"):
        for lo in range(0, rows.shape[0], block):
            keys[lo : lo + block] = rows[lo : lo + block].astype(np.int64) @ weights
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    distinct = rows[first]
    assert (distinct[inverse] == rows).all(), "row hash collision"
    return distinct, inverse

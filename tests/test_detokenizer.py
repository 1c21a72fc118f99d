"""IncrementalDetokenizer against the real tokenizer of the bundled SmolLM2 (byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.runner.detokenizer import (
    MAX_HELD_TOKENS,
    NUM_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    decode_token,
)
from pdserve.runner.model_source import resolve_model_dir

HAND_PICKED = [
    "Hello, world!",
    "😀 emoji 👍🏽 and flags 🇯🇵🏳️‍🌈",
    "你好，世界。日本語のテキスト",
    "naïve café — Ω≈ç√",
    "<|im_start|>assistant\nhi<|im_end|>",
    "  two  spaces\t\n",
    "a\u200db\ufffdc",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])


@pytest.fixture(scope="module")
def awkward_ids(tok) -> list[int]:
    """Ids that stress the hold-back: partial UTF-8 tokens, special tokens, emoji/CJK pieces."""
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 100, "expected byte-level tokens holding parts of characters"
    special = list(tok.added_tokens_decoder)
    pieces = [i for text in HAND_PICKED for i in tok.encode(text)]
    return sorted(set(partial + special + pieces))


def stream(tok, prompt: list[int], output: list[int], chunks: list[int], skip: bool):
    """Feed `output` in chunks of the given sizes (cycled); return (pieces, flushed detok)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces, pos, k = [], 0, 0
    while pos < len(output):
        size = chunks[k % len(chunks)]
        pieces.append(detok.add_tokens(output[pos : pos + size]))
        pos, k = pos + size, k + 1
    pieces.append(detok.flush())
    return pieces, detok


@settings(max_examples=400, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_matches_full_decode(tok, awkward_ids, data, skip):
    """Guards against the windowed decode drifting from decode(): dropped or duplicated
    characters at window edges, partial characters emitted early, specials merging bytes."""
    token = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(awkward_ids))
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    output = data.draw(st.lists(token, max_size=48), label="output")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    pieces, detok = stream(tok, prompt, output, chunks, skip)
    assert detok.output_text == tok.decode(output, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", HAND_PICKED)
def test_valid_text_never_streams_replacement_chars(tok, text, skip):
    """Guards against emitting half an emoji/CJK character: a client would see U+FFFD in the
    stream even though the final text is valid."""
    output = tok.encode(text)
    pieces, detok = stream(tok, tok.encode("User: hi\nAssistant:"), output, [1], skip)
    assert detok.output_text == tok.decode(output, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text
    expected_fffd = text.count("\ufffd")  # the one in the input is a real character
    assert sum(p.count("\ufffd") for p in pieces) == expected_fffd


def test_partial_character_is_held_until_flush(tok):
    """Guards against losing held-back bytes when the request ends mid-character."""
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(tok.encode("ok")) == "ok"
    assert detok.add_tokens(emoji[:-1]) == ""
    assert detok.flush() == tok.decode(emoji[:-1]) == "\ufffd"
    assert detok.output_text == "ok\ufffd"


def test_prompt_ending_mid_character(tok):
    """Guards against the prompt's unfinished bytes joining the output's first bytes (the
    output would then claim a character it holds only part of, unlike decode(output))."""
    cjk = tok.encode("你好")
    prompt, output = cjk[:1], cjk[1:] + tok.encode(" ok")
    _, detok = stream(tok, prompt, output, [1], skip=True)
    assert detok.output_text == tok.decode(output)
    assert detok.output_text.startswith("\ufffd")


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: its decoder drops the first token's leading space."""
    backend = Tokenizer(
        models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>")
    )
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_metaspace_first_word_keeps_its_space():
    """Guards against streams reading "Helloworld": without prompt context (or with only
    skipped specials as context) a Metaspace decoder strips the first output word's space.
    This is the documented case where output_text != decode(output_ids) on purpose."""
    tok = _metaspace_tokenizer()
    eos = tok.convert_tokens_to_ids("<eos>")
    assert tok.decode([2]) == "world"  # what decode(output_ids) alone gives
    _, detok = stream(tok, [1] + [eos] * (NUM_CONTEXT_TOKENS + 1), [2, 3], [1], skip=True)
    assert detok.output_text == " world!"
    # A run of skipped specials longer than the hold limit must not become the only context.
    _, detok = stream(tok, [1], [3] + [eos] * 3 * MAX_HELD_TOKENS + [2], [1], skip=True)
    assert detok.output_text == tok.decode([1, 3, 2], skip_special_tokens=True)[len("Hello") :]


class _DecodeSpy:
    """Wraps a tokenizer and records the longest id list passed to decode()."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.added_tokens_decoder = tok.added_tokens_decoder
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_window_stays_bounded(tok, skip):
    """Guards against O(n) decoding per step: a long answer, a run of skipped specials
    (ignore_eos) and a run of lone lead bytes (garbage that ends in U+FFFD after every token)
    must all keep the decoded window short."""
    lead_bytes = tok.encode("你")[:1]  # 2 of the 3 bytes of a CJK character
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    output = (
        tok.encode("A long answer. " * 60)
        + [im_end] * 200
        + lead_bytes * 200
        + tok.encode("你好 done")
    )
    spy = _DecodeSpy(tok)
    _, detok = stream(spy, tok.encode("prompt " * 50), output, [1], skip)
    assert detok.output_text == tok.decode(output, skip_special_tokens=skip)
    # Context, one step of emitted text, and at most MAX_HELD_TOKENS + 1 held tokens twice.
    assert spy.longest <= NUM_CONTEXT_TOKENS + 2 * (MAX_HELD_TOKENS + 1) + 1, spy.longest


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_garbage_run_then_valid_character(tok, chunk):
    """Guards against the hold limit settling an unfinished character: after a run of lone
    lead bytes (each made final by the next), a character arrives one byte per token, so the
    limit is hit with the window ending inside it."""
    lead_bytes = tok.encode("你")[:1]
    # Byte-level BPE spells bytes E4 BD A0 ("你") as these three one-byte tokens.
    one_byte_tokens = tok.convert_tokens_to_ids(list("\u00e4\u00bd\u0142"))
    assert tok.decode(one_byte_tokens) == "你"
    for run in range(3 * MAX_HELD_TOKENS):
        output = lead_bytes * run + one_byte_tokens + tok.encode("好")
        _, detok = stream(tok, [], output, [chunk], skip=True)
        assert detok.output_text == tok.decode(output), run


def test_decode_token(tok):
    """Guards against logprob display dropping special tokens or leading spaces."""
    assert decode_token(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    (space_x,) = tok.encode(" x")
    assert decode_token(tok, space_x) == " x"
    assert decode_token(tok, tok.encode("你")[0]) == "\ufffd"


def test_add_after_flush_is_rejected(tok):
    """Guards against reusing a finished detokenizer, whose held bytes were already flushed."""
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(tok.encode("x"))
    detok.flush()
    with pytest.raises(AssertionError):
        detok.add_tokens(tok.encode("y"))

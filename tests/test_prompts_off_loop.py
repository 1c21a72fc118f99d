"""The routes' prompts are encoded off the router's event loop (cluster/prompts.py): one
long prompt must not stall the streams the loop relays, and what comes back is what the
encoding on the loop gave."""

from __future__ import annotations

import asyncio

import pytest
from loop_ticks import ticks_while

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import completion_prompts, off_loop, prompt_token_ids

# ~1 MB of text: ~0.7 s to encode on one core of this machine.
LONG = " ".join(f"word{i % 977} lorem ipsum" for i in range(50_000))


@pytest.fixture(scope="module")
def tok(smollm_dir):
    from pdserve.runner.tokenizer import load_tokenizer

    return load_tokenizer(smollm_dir)


def test_a_long_prompt_is_encoded_while_the_loop_runs(tok):
    """Guards the router's loop: it ticks on while a ~1 MB chat and completion are encoded
    (on the loop, it ticked 0 times), and the ids equal those encoded on the loop."""
    chat = {"messages": [{"role": "user", "content": LONG}]}
    ticks, ids = ticks_while(lambda: off_loop(prompt_token_ids, chat, "chat", tok, None))
    assert ticks >= 5, f"the loop ticked {ticks} times while the chat was encoded"
    assert ids == prompt_token_ids(chat, "chat", tok) and len(ids) > 100_000
    body = {"prompt": [LONG, "short"]}
    ticks, prompts = ticks_while(lambda: off_loop(completion_prompts, body, tok, 49_152))
    assert ticks >= 5 and prompts == completion_prompts(body, tok, 49_152)


def test_errors_pass_through_and_the_wait_is_bounded(tok):
    """A bad prompt is the same 400 off the loop; an encode past the bound is a 400 too."""
    with pytest.raises(ApiError, match="'prompt' is empty"):
        asyncio.run(off_loop(prompt_token_ids, {"prompt": ""}, "completion", tok))
    chat = {"messages": [{"role": "user", "content": LONG}]}
    with pytest.raises(ApiError, match="not tokenized within 0 s"):
        asyncio.run(off_loop(prompt_token_ids, chat, "chat", tok, None, timeout_s=0.001))

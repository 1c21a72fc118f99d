"""The router's msgpack messages to workers (cluster/wire.py): what goes in comes out, and
anything else is refused with a message that names the field."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.cluster.wire import WIRE_VERSION, FirstToken, WorkRequest
from pdserve.runner.sampling_params import SamplingParams


def test_first_token_and_work_request_round_trip():
    msg = FirstToken("r-1", 42, [[42, -0.25, 1], [7, -1.5, 2]])
    assert FirstToken.decode(msg.encode()) == msg
    assert FirstToken.decode(FirstToken("r-2", 0).encode()) == FirstToken("r-2", 0, None)
    req = WorkRequest("r-3", [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=4))
    back = WorkRequest.decode(req.encode())
    assert (back.request_id, back.prompt_token_ids, back.ticket) == ("r-3", [1, 2, 3], None)
    assert (back.params.temperature, back.params.max_tokens) == (0.5, 4)


def _packed(**body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "body, fragment",
    [
        (dict(v=WIRE_VERSION + 1, id="r", t=1, l=None), "wire version"),
        (dict(v=WIRE_VERSION, id="r", t=1), "unexpected fields"),
        (dict(v=WIRE_VERSION, id="r", t=1, l=None, x=0), "unexpected fields"),
        (dict(v=WIRE_VERSION, id=5, t=1, l=None), "id must be a string"),
        (dict(v=WIRE_VERSION, id="r", t=1.0, l=None), "t a token id"),
        (dict(v=WIRE_VERSION, id="r", t=True, l=None), "t a token id"),
        (dict(v=WIRE_VERSION, id="r", t=1, l=[[1, -0.5]]), "rows of"),
        (dict(v=WIRE_VERSION, id="r", t=1, l=[[1, "x", 1]]), "rows of"),
        (dict(v=WIRE_VERSION, id="r", t=1, l="rows"), "rows of"),
    ],
)
def test_first_token_refuses_a_malformed_message(body, fragment):
    with pytest.raises(ValueError, match=fragment):
        FirstToken.decode(_packed(**body))

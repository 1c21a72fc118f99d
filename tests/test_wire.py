"""The router's msgpack messages to workers (cluster/wire.py): what goes in comes out, and
anything else is refused with a message that names the field."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.cluster.wire import WIRE_VERSION, FirstToken, WorkRequest
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.pooling import PoolingParams, pooling_from_wire, pooling_to_wire
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


def test_a_work_request_carries_logit_bias_and_allowed_ids():
    """Guards the two token-id fields on the wire: logit_bias (integer keys, which msgpack
    maps here do not take) travels as [id, bias] pairs and comes back as the same map, so
    a prefill worker samples the first token with the bias the decode worker uses; a
    malformed pair list, or a bias SamplingParams would refuse, is refused on arrival."""
    params = SamplingParams(
        logit_bias={5: 2.5, 49_000: -100}, allowed_token_ids=[5, 9], priority=-3,
        bad_words=["never", "say never"],
    )  # fmt: skip
    back = WorkRequest.decode(WorkRequest("r-4", [1], params).encode())
    assert back.params.priority == -3  # each hop of a PD request schedules by it
    assert back.params.bad_words == ["never", "say never"]  # each worker tokenizes them
    assert back.params.logit_bias == {5: 2.5, 49_000: -100.0}
    assert back.params.allowed_token_ids == [5, 9]
    assert WorkRequest.decode(WorkRequest("r-5", [1], SamplingParams()).encode()).params == (
        SamplingParams()
    )
    good = {k: getattr(SamplingParams(), k) for k in ("temperature", "max_tokens")}
    for bias, fragment in (
        ({"5": 2.5}, "pairs"),
        ([[5, 2.5, 1]], "pairs"),
        ([[5, 200.0]], r"\[-100, 100\]"),
    ):
        body = dict(v=WIRE_VERSION, id="r", prompt=[1], ticket=None, lora=None, lora_path=None, embed=None,
                    params={**good, "logit_bias": bias})  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            WorkRequest.decode(_packed(**body))


def test_a_work_request_carries_the_cache_salt():
    """Guards tenant isolation across the PD hops: a salt dropped on the way to a worker
    would make that worker hash the prompt unsalted and hit another tenant's blocks; a
    salt SamplingParams would refuse is refused on arrival."""
    params = SamplingParams(cache_salt="tenant-é")
    back = WorkRequest.decode(WorkRequest("r-6", [1], params).encode())
    assert back.params.cache_salt == "tenant-é"
    assert WorkRequest.decode(WorkRequest("r-7", [1], SamplingParams()).encode()).params == (
        SamplingParams(cache_salt=None)
    )
    for salt in ("", 5):
        body = dict(v=WIRE_VERSION, id="r", prompt=[1], ticket=None, lora=None, lora_path=None, embed=None,
                    params={"max_tokens": 2, "cache_salt": salt})  # fmt: skip
        with pytest.raises(ValueError, match="cache_salt"):
            WorkRequest.decode(_packed(**body))


def test_a_work_request_carries_its_lora_adapter():
    """The adapter a request runs with reaches both PD workers (a dropped one would decode
    with the base model's weights over the adapter's KV): its key and folder, or null."""
    req = WorkRequest("r-8", [1], SamplingParams(), lora="tuned@1", lora_path="/a/tuned")
    back = WorkRequest.decode(req.encode())
    assert back.lora_request() == LoRARequest("tuned@1", 1, "/a/tuned")
    back = WorkRequest.decode(WorkRequest("r-9", [1], SamplingParams()).encode())
    assert back.lora is None and back.lora_request() is None
    for lora, path in ((3, "/a"), ("a", None), (None, "/a"), ("", "/a"), ("a", "")):
        body = dict(v=WIRE_VERSION, id="r", prompt=[1], ticket=None, lora=lora, lora_path=path,
                    embed=None, params={})  # fmt: skip
        with pytest.raises(ValueError, match="lora"):
            WorkRequest.decode(_packed(**body))


def test_embedding_requests_and_vectors_cross_the_wire():
    """An embedding request reaches its worker as one (else it would generate a token);
    its vector comes back on the stream delta; malformed forms are refused on arrival."""
    from pdserve.cluster.token_stream import StreamDelta

    for task, params in (("embed", PoolingParams(normalize=False, dimensions=8)),
                         ("classify", PoolingParams(activation=False))):  # fmt: skip
        embed = pooling_to_wire(task, params)
        req = WorkRequest("r-10", [1, 2], SamplingParams(max_tokens=1), embed=embed)
        assert pooling_from_wire(WorkRequest.decode(req.encode()).embed) == (task, params)
    good = pooling_to_wire("embed", None)
    for embed in ({**good, "normalize": "yes"}, {**good, "x": 1}, [True], {"normalize": None},
                  {**good, "task": "generate"}, {**good, "dimensions": 0}):  # fmt: skip
        body = dict(v=WIRE_VERSION, id="r", prompt=[1], ticket=None, lora=None, lora_path=None, embed=embed,
                    params={})  # fmt: skip
        with pytest.raises(ValueError, match="embed"):
            WorkRequest.decode(_packed(**body))
    delta = StreamDelta("r", [], "", "stop", None, None, 2, 0, embedding=[0.5, -1.0])
    assert StreamDelta.from_wire(delta.to_wire()).embedding == [0.5, -1.0]
    with pytest.raises(ValueError, match="embedding"):
        StreamDelta.from_wire({**delta.to_wire(), "e": ["x"]})

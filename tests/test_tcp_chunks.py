"""A tcp pull is packed and sent in chunks of whole layers (kvtransfer/server.py): every
chunk size, remainders included, lands bitwise; the frames are the chunks, per tensor.
Real sockets (tcp on loopback), a real lease table, a hybrid layout (GQA + Mamba state)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer import server as server_mod
from pdserve.kvtransfer.layout import KVLayout, MambaStateGroup, PagedGQAGroup
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.server import KVSourceServer, chunk_layers
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec
from pdserve.kvtransfer.transport_tcp import TcpTransport

_GQA = PagedGQAGroup("attn", 5, 4, 2, 8, "bfloat16")  # 5 layers: chunks leave remainders
_MAMBA = MambaStateGroup("mamba", 3, (5, 3), (3, 7), "bfloat16", "float32")
_LAYOUT = KVLayout("tiny-hybrid", (_GQA, _MAMBA))
_SRC = [[6, 1, 3, 7], [2]]
_DST = [[0, 5, 2, 4], [1]]


def _filled(group, num_units: int, seed: int):
    storage = group.allocate(num_units)
    g = torch.Generator().manual_seed(seed)
    for t in storage.tensors:
        bitwise_view(t).copy_(torch.randint(-(2**15), 2**15, bitwise_view(t).shape, generator=g))
    return storage


def test_chunk_layers_stays_under_the_chunk_size(monkeypatch):
    storage = _GQA.allocate(8)
    per_layer = 4 * _GQA.unit_bytes() // _GQA.num_layers  # 4 units
    monkeypatch.setattr(server_mod, "CHUNK_BYTES", 2 * per_layer + 1)
    assert chunk_layers(storage, 4) == 2
    monkeypatch.setattr(server_mod, "CHUNK_BYTES", per_layer - 1)
    assert chunk_layers(storage, 4) == 1  # never below one layer
    monkeypatch.setattr(server_mod, "CHUNK_BYTES", 100 * per_layer)
    assert chunk_layers(storage, 4) == 100  # capped by the layers there are, by the caller


@pytest.mark.parametrize("layers_per_chunk", [1, 2, 3, 5])
def test_a_chunked_pull_lands_bitwise(monkeypatch, layers_per_chunk):
    """Guards the chunk loop: layer ranges [start, end) cover every layer once, the last
    chunk shorter where the count does not divide, each group chunked on its own sizes."""
    per_layer = len(_SRC[0]) * _GQA.unit_bytes() // _GQA.num_layers
    monkeypatch.setattr(server_mod, "CHUNK_BYTES", layers_per_chunk * per_layer)
    src = (_filled(_GQA, 8, 1), _filled(_MAMBA, 3, 2))
    leases = LeaseTable(30.0)
    lease = leases.add("r", _SRC, 9)
    server = KVSourceServer(KVSource("P", _LAYOUT, src, leases))
    transport = TcpTransport("D", _LAYOUT)
    try:
        ticket = Ticket(
            "r", "P", server.endpoint, _SRC, 9, _LAYOUT.compat_hash(), lease.expiry,
            None, None, None,
        )  # fmt: skip
        dst = (_GQA.allocate(8), _MAMBA.allocate(3))
        for d in dst:
            for t in d.tensors:
                t.fill_(float("nan"))
        moved = transport.pull(PullSpec(ticket, tuple(map(tuple, _DST)), (0, 0)), dst, 20.0)
        assert moved == sum(len(ids) * g.unit_bytes() for ids, g in zip(_SRC, _LAYOUT.groups))
        for s, d, s_ids, d_ids in zip(src, dst, _SRC, _DST):
            for ts, td in zip(s.flat(), d.flat()):
                assert torch.equal(bitwise_view(td)[:, d_ids], bitwise_view(ts)[:, s_ids]), (
                    f"{s.group.name}: units differ"
                )
        # Frames: per group, its chunks times its tensors.
        gqa_chunks = -(-_GQA.num_layers // layers_per_chunk)
        mamba_chunks = -(-_MAMBA.num_layers // chunk_layers(src[1], 1))
        want = gqa_chunks * len(src[0].tensors) + mamba_chunks * len(src[1].tensors)
        assert server.counts["pulls"] == 1
        assert server.counts["bytes"] == moved
        assert server.counts["frames"] == want
    finally:
        transport.close()
        server.close()

"""KV layout descriptors: the compat hash, the handshake's mismatch messages, the wire
form, validation, and `GroupStorage` (including the runner's own cache as a storage)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import msgpack
import pytest
import torch

from pdserve.kvtransfer.layout import (
    LAYOUT_VERSION,
    GroupStorage,
    KVLayout,
    LayoutMismatch,
    MambaStateGroup,
    PagedGQAGroup,
    PagedMLAGroup,
    gqa_layout_for,
)
from pdserve.runner.mrv2.kv_cache import allocate_blocks, block_bytes

GQA = PagedGQAGroup("kv", 4, 16, 8, 128, "bfloat16")
MLA = PagedMLAGroup("latent", 3, 64, 512, 64, "float8_e4m3fn")
MAMBA = MambaStateGroup("ssm", 2, (96, 3), (8, 64, 16), "bfloat16", "float32")
HYBRID = KVLayout("hybrid-model", (GQA, MAMBA))

# One changed value per field, of the right type, for every group kind.
CHANGES = {
    "name": "other",
    "num_layers": 5,
    "block_size": 32,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "float16",
    "kv_lora_rank": 256,
    "rope_dim": 32,
    "conv_shape": (96, 4),
    "ssm_shape": (8, 64, 32),
    "conv_dtype": "float32",
    "ssm_dtype": "bfloat16",
}


def _single_field_changes(group):
    for f in dataclasses.fields(group):
        yield (
            f.name,
            getattr(group, f.name),
            dataclasses.replace(group, **{f.name: CHANGES[f.name]}),
        )


def _wire_trip(layout: KVLayout) -> KVLayout:
    return KVLayout.from_wire(msgpack.unpackb(msgpack.packb(layout.to_wire())))


def test_compat_hash_equal_for_equal_layouts_built_differently():
    """A hash over object identity or over tuple-vs-list would make equal peers refuse
    each other: the helper, the constructor and a msgpack round trip must agree."""
    by_helper = gqa_layout_for("m", 4, 16, 8, 128, torch.bfloat16)
    by_hand = KVLayout(model="m", groups=[PagedGQAGroup("kv", 4, 16, 8, 128, "bfloat16")])
    assert by_helper == by_hand
    assert by_helper.compat_hash() == by_hand.compat_hash() == _wire_trip(by_hand).compat_hash()
    assert _wire_trip(HYBRID).compat_hash() == HYBRID.compat_hash()
    by_helper.check_compatible(_wire_trip(by_hand))
    HYBRID.check_compatible(_wire_trip(HYBRID))


def test_compat_hash_same_in_another_process():
    """A hash built on Python's `hash()` (salted per process) would differ between the
    prefill and the decode worker; a fresh interpreter with another seed must agree."""
    code = (
        "from pdserve.kvtransfer.layout import *\n"
        "g = PagedGQAGroup('kv', 4, 16, 8, 128, 'bfloat16')\n"
        "m = MambaStateGroup('ssm', 2, (96, 3), (8, 64, 16), 'bfloat16', 'float32')\n"
        "print(KVLayout('hybrid-model', (g, m)).compat_hash())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == HYBRID.compat_hash()


@pytest.mark.parametrize("group", [GQA, MLA, MAMBA], ids=lambda g: g.kind)
def test_every_single_field_change_changes_hash_and_is_named(group):
    """A field left out of the hash or the comparison would let peers with different
    geometry exchange blocks and read garbage; each field must show, with both values."""
    base = KVLayout("m", (group,))
    for field, old, changed in _single_field_changes(group):
        peer = KVLayout("m", (changed,))
        assert peer.compat_hash() != base.compat_hash(), field
        with pytest.raises(LayoutMismatch) as exc:
            base.check_compatible(peer)
        new = CHANGES[field]
        assert f"group 0 {group.name!r} {field}: {old!r} here vs {new!r} on the peer" in str(
            exc.value
        )


def test_layout_level_changes_named():
    """Model, version, group count and kind mismatches must say which and both values,
    not just 'incompatible'."""
    base = KVLayout("a", (GQA,))
    cases = [
        (KVLayout("b", (GQA,)), "model: 'a' here vs 'b' on the peer"),
        (
            KVLayout("a", (GQA,), version=LAYOUT_VERSION + 1),
            f"layout version: {LAYOUT_VERSION} here vs {LAYOUT_VERSION + 1} on the peer",
        ),
        (KVLayout("a", (GQA, MAMBA)), "number of groups: 1 here vs 2 on the peer"),
        (
            KVLayout("a", (dataclasses.replace(MLA, name="kv"),)),
            "group 0 'kv' kind: 'paged_gqa' here vs 'paged_mla' on the peer",
        ),
    ]
    for peer, message in cases:
        assert peer.compat_hash() != base.compat_hash(), message
        with pytest.raises(LayoutMismatch, match="KV layout mismatch") as exc:
            base.check_compatible(peer)
        assert message in str(exc.value)
        assert isinstance(exc.value, ValueError)


def test_several_differences_all_reported():
    """Reporting only the first difference makes an operator fix configs one restart at a
    time; every differing field is listed."""
    peer = KVLayout("b", (dataclasses.replace(GQA, block_size=32, dtype="float16"),))
    with pytest.raises(LayoutMismatch) as exc:
        KVLayout("a", (GQA,)).check_compatible(peer)
    text = str(exc.value)
    for part in ("model: 'a'", "block_size: 16 here vs 32", "dtype: 'bfloat16' here vs 'float16'"):
        assert part in text


def test_wire_round_trip_restores_tuples_and_groups():
    """msgpack turns tuples into lists; a from_wire that kept lists would break equality
    (and hashing) of the Mamba shapes."""
    for layout in (HYBRID, KVLayout("mla", (MLA,))):
        back = _wire_trip(layout)
        assert back == layout
        assert all(type(g) is type(h) for g, h in zip(back.groups, layout.groups))
    assert isinstance(_wire_trip(HYBRID).groups[1].conv_shape, tuple)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda w: w["groups"][0].pop("head_dim"), "missing field(s) ['head_dim']"),
        (lambda w: w["groups"][0].update(extra=1), "unknown field(s) ['extra']"),
        (lambda w: w["groups"][0].update(block_size="16"), "'block_size' must be int"),
        (lambda w: w["groups"][0].update(block_size=True), "'block_size' must be int"),
        (lambda w: w["groups"][0].update(block_size=16.0), "'block_size' must be int"),
        (lambda w: w["groups"][0].update(block_size=0), "block_size must be a positive int"),
        (lambda w: w["groups"][0].update(dtype="torch.bfloat16"), "dtype must be one of"),
        (lambda w: w["groups"][0].update(kind="paged_xyz"), "kind must be one of"),
        (lambda w: w["groups"][1].update(conv_shape=["96", 3]), "conv_shape must be a non-empty"),
        (lambda w: w["groups"][1].update(ssm_shape=7), "'ssm_shape' must be tuple"),
        (lambda w: w.pop("model"), "missing ['model']"),
        (lambda w: w.update(extra=1), "unknown ['extra']"),
        (lambda w: w.update(version="1"), "'version' must be int"),
        (lambda w: w.update(groups={}), "'groups' must be a list"),
        (lambda w: w.update(groups=[]), "groups must be a non-empty tuple"),
    ],
)
def test_from_wire_rejects_bad_fields(edit, needle):
    """A peer's malformed handshake must fail with a ValueError naming the field, not a
    KeyError/TypeError deep inside, nor be accepted with a wrong type (True as 1)."""
    wire = HYBRID.to_wire()
    edit(wire)
    with pytest.raises(ValueError) as exc:
        KVLayout.from_wire(wire)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: PagedGQAGroup("", 4, 16, 8, 128, "bfloat16"), "name must be a non-empty str"),
        (lambda: PagedGQAGroup("kv", 0, 16, 8, 128, "bfloat16"), "num_layers must be a positive"),
        (lambda: PagedGQAGroup("kv", 4, -16, 8, 128, "bfloat16"), "block_size must be a positive"),
        (lambda: PagedGQAGroup("kv", 4, 16, 8, 128, "bf16"), "dtype must be one of"),
        (lambda: PagedMLAGroup("l", 3, 64, 512, 0, "float16"), "rope_dim must be a positive"),
        (lambda: MambaStateGroup("s", 2, (), (8,), "float32", "float32"), "conv_shape must be"),
        (lambda: MambaStateGroup("s", 2, (4,), [8], "float32", "float32"), "ssm_shape must be"),
        (lambda: MambaStateGroup("s", 2, (4,), (8,), "float32", "int8"), "ssm_dtype must be"),
        (lambda: KVLayout("", (GQA,)), "model must be a non-empty str"),
        (lambda: KVLayout("m", ()), "groups must be a non-empty tuple"),
        (lambda: KVLayout("m", (GQA, GQA)), "group names must be unique"),
        (lambda: KVLayout("m", (GQA,), version=0), "version must be a positive int"),
        (lambda: gqa_layout_for("m", 4, 16, 8, 128, torch.int8), "dtype must be one of"),
    ],
)
def test_validation_names_the_rule(make, needle):
    """A bad config must fail at construction with the rule, not later as a shape error
    in the middle of a transfer."""
    with pytest.raises(ValueError) as exc:
        make()
    assert needle in str(exc.value)


def test_sizes_match_the_runner_cache():
    """The transfer layout must describe the runner's cache exactly: a drift in axis
    order or per-block bytes would ship the wrong bytes without any error."""
    block_shape = (2, 4, 3, 20)  # a GQA model's kv_block_shape(4): [2, bs, H, D]
    cache, _ = allocate_blocks(2, 5, block_shape, torch.float16, torch.device("cpu"))
    layout = gqa_layout_for("m", 2, 4, 3, 20, torch.float16)
    group = layout.groups[0]
    storage = GroupStorage(group, (cache,))
    assert storage.num_units == 5
    assert group.unit_bytes() == block_bytes(2, block_shape, torch.float16)
    assert tuple(group.allocate(5).tensors[0].shape) == tuple(cache.shape)
    assert MAMBA.unit_bytes() == 2 * (96 * 3 * 2 + 8 * 64 * 16 * 4)
    assert MLA.unit_shapes() == ((64, 576),) and MLA.unit_bytes() == 3 * 64 * 576


def test_flat_is_a_view_of_the_storage():
    """If flat() returned a copy, unpack would write into a temporary and the cache would
    silently keep its old contents."""
    storage = MAMBA.allocate(3)
    conv, ssm = storage.flat()
    assert conv.shape == (2, 3, 96 * 3) and ssm.shape == (2, 3, 8 * 64 * 16)
    ssm[1, 2, 5] = 7.0
    assert storage.tensors[1][1, 2].reshape(-1)[5] == 7.0


def test_group_storage_checks_tensors():
    """A storage with a transposed, mistyped or gappy tensor would make the flat
    [L, NU, E] view mix units; construction must refuse it and say why."""
    good = GQA.allocate(3).tensors[0]
    with pytest.raises(ValueError, match="expected \\[num_layers, num_units"):
        GroupStorage(GQA, (good.transpose(0, 1),))
    with pytest.raises(ValueError, match="dtype torch.float16, expected torch.bfloat16"):
        GroupStorage(GQA, (good.to(torch.float16),))
    with pytest.raises(ValueError, match="has 2 tensor"):
        GroupStorage(MAMBA, (MAMBA.allocate(2).tensors[0],))
    gappy = torch.zeros(4, 3, 2, 16, 8, 256, dtype=torch.bfloat16)[..., :128]
    with pytest.raises(ValueError, match="dense below the layer axis"):
        GroupStorage(GQA, (gappy,))
    # A range of units of a bigger cache is fine: only the layer stride is larger.
    window = GroupStorage(GQA, (good[:, 1:3],))
    assert window.num_units == 2
    assert window.flat()[0].stride(0) == good.stride(0)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_host_cache_is_zeros_that_take_memory_only_where_written():
    """The host cache reads as zeros everywhere (what the kernels' padding and the null
    block rely on), its per-layer views write into it, and a 256 MiB cache does not take
    256 MiB at start: `torch.zeros` wrote every page up front, seconds of page faults in
    each worker's start on the 2-core dev machine."""
    block_shape = (2, 16, 8, 64)  # [2, bs, H, D] in bfloat16: 32 KiB a block
    before = _resident_bytes()
    cache, layers = allocate_blocks(8, 1024, block_shape, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (8, 1024, *block_shape) and cache.nbytes == 256 << 20
    assert _resident_bytes() - before < 32 << 20
    assert cache.dtype == torch.bfloat16 and cache.is_contiguous()
    layers[3][17].fill_(1.5)
    assert cache[3, 17].eq(1.5).all() and cache[3, 16].eq(0).all() and cache[2, 17].eq(0).all()
    assert int(cache.count_nonzero()) == 2 * 16 * 8 * 64
    fp8, _ = allocate_blocks(1, 3, (4,), torch.float8_e4m3fn, torch.device("cpu"))
    assert fp8.dtype == torch.float8_e4m3fn and fp8.float().eq(0).all()

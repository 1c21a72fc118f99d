"""The secondary KV tier: bitwise storage, LRU eviction, disk spill, thread safety."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from pdserve.kvtransfer.tier import HostKVTier

LAYERS, E = 3, 40  # a block tensor is [num_layers, E]; E not a power of two
FP8 = torch.float8_e4m3fn


def make_block(h: int, dtypes=(torch.bfloat16, torch.bfloat16)) -> tuple[torch.Tensor, ...]:
    """Every bit pattern possible (NaNs and infs included): content is random bytes seeded
    by the hash, so blocks of different hashes differ and a conversion would show."""
    g = torch.Generator().manual_seed(h % (1 << 63))
    out = []
    for dtype in dtypes:
        size = dtype.itemsize
        raw = torch.randint(0, 256, (LAYERS, E * size), generator=g, dtype=torch.uint8)
        out.append(raw.view(dtype))
    return tuple(out)


def block_bytes(dtypes=(torch.bfloat16, torch.bfloat16)) -> int:
    return sum(LAYERS * E * d.itemsize for d in dtypes)


def assert_bitwise(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.device.type == "cpu"
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_put_lookup_get_bitwise(dtype):
    """Blocks coming back converted (bf16 through float) or with another hash's bytes."""
    tier = HostKVTier(byte_budget=1 << 20)
    hashes = [11, 2**64 - 1, 0]
    blocks = [make_block(h, (dtype, dtype)) for h in hashes]
    assert tier.put("L1", hashes, blocks) == 3
    assert tier.put("L1", hashes, blocks) == 0  # already present: nothing new
    assert tier.lookup("L1", hashes) == 3
    for got, want in zip(tier.get("L1", hashes), blocks):
        assert_bitwise(got, want)
    stats = tier.stats()
    assert stats["num_blocks"] == 3 and stats["bytes"] == 3 * block_bytes((dtype, dtype))
    assert stats["puts"] == 3 and stats["hits"] == 3 and stats["misses"] == 0
    assert stats["loaded"] == 3  # read back once each; a lookup then a get is one hit


def test_tier_never_shares_storage_with_callers():
    """A caller writing into its KV buffer (or into a get result) corrupting the tier."""
    tier = HostKVTier(byte_budget=1 << 20)
    block = make_block(5)
    want = tuple(t.clone() for t in block)
    strided = tuple(t.t().contiguous().t() for t in make_block(6))  # non-contiguous input
    tier.put("L", [5, 6], [block, strided])
    block[0].view(torch.uint8).zero_()
    (got, got_strided) = tier.get("L", [5, 6])
    got[0].view(torch.uint8).fill_(7)
    assert_bitwise(tier.get("L", [5])[0], want)
    assert all(t.is_contiguous() for t in got_strided)
    assert_bitwise(got_strided, make_block(6))


def test_lookup_counts_leading_blocks_only():
    """Counting a later block after a hole: its KV is useless without the blocks before it."""
    tier = HostKVTier(byte_budget=1 << 20)
    tier.put("L", [1, 2, 4], [make_block(h) for h in (1, 2, 4)])
    assert tier.lookup("L", [1, 2, 3, 4]) == 2
    assert tier.lookup("L", [3, 1, 2]) == 0
    assert tier.lookup("L", []) == 0
    with pytest.raises(KeyError, match="block 3 of layout L"):
        tier.get("L", [1, 2, 3, 4])
    assert tier.stats()["misses"] == 3


def test_lru_eviction_order_and_touch():
    """Evicting the most recently used block, or a lookup/get not counting as a use."""
    b = block_bytes()
    tier = HostKVTier(byte_budget=3 * b)
    for h in (1, 2, 3):
        tier.put("L", [h], [make_block(h)])
    assert tier.lookup("L", [1]) == 1  # 1 is now the most recent; 2 the least
    tier.put("L", [4], [make_block(4)])
    assert [tier.lookup("L", [h]) for h in (1, 2, 3, 4)] == [1, 0, 1, 1]
    tier.get("L", [3])  # order now (oldest first): 1, 4, 3
    tier.put("L", [5], [make_block(5)])
    assert [tier.lookup("L", [h]) for h in (1, 3, 4, 5)] == [0, 1, 1, 1]
    stats = tier.stats()
    assert stats["evictions"] == 2 and stats["bytes"] == 3 * b <= tier.byte_budget


def test_eviction_takes_a_chain_tail_before_its_head():
    """Evicting block 0 of a prefix, which makes every later block unreachable by lookup."""
    tier = HostKVTier(byte_budget=3 * block_bytes())
    tier.put("L", [10, 11, 12], [make_block(h) for h in (10, 11, 12)])
    tier.put("L", [20], [make_block(20)])
    assert tier.lookup("L", [10, 11, 12]) == 2
    # Order now (oldest first): 20, 11, 10 — the lookup touched 11 before 10.
    tier.put("L", [30], [make_block(30)])
    tier.put("L", [40], [make_block(40)])
    assert tier.lookup("L", [10, 11]) == 1 and tier.lookup("L", [20]) == 0


def test_spill_to_disk_and_read_back_bitwise(tmp_path):
    """Spilled bytes reinterpreted (fp8/bf16 through numpy) or a spilled block not found."""
    dtypes = (torch.bfloat16, FP8, torch.float16, torch.float32)
    b = block_bytes(dtypes)
    tier = HostKVTier(byte_budget=2 * b, spill_dir=tmp_path / "spill", spill_budget=1 << 20)
    hashes = [100, 101, 102, 2**64 - 1]
    for h in hashes:
        tier.put("L", [h], [make_block(h, dtypes)])
    stats = tier.stats()
    assert stats["num_blocks"] == 2 and stats["spilled_blocks"] == 2
    files = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert files == [f"L-{100:016x}.kvblock", f"L-{101:016x}.kvblock"]  # no temp files left
    assert stats["spilled_bytes"] == sum(p.stat().st_size for p in (tmp_path / "spill").iterdir())
    assert tier.lookup("L", hashes) == 4
    for h, got in zip(hashes, tier.get("L", hashes)):
        assert_bitwise(got, make_block(h, dtypes))
    # The get brought 100 and 101 back as the most recent, so 102 and 2**64-1 went to disk.
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == [
        f"L-{102:016x}.kvblock",
        f"L-{2**64 - 1:016x}.kvblock",
    ]
    assert tier.stats()["bytes"] == 2 * b
    assert [tier.lookup("L", [h]) for h in hashes] == [1, 1, 1, 1]
    tier.clear()
    assert list((tmp_path / "spill").iterdir()) == []
    assert tier.stats()["num_blocks"] == tier.stats()["spilled_blocks"] == 0


def test_spill_budget_deletes_oldest_files(tmp_path):
    """Spill files growing without bound, or the newest deleted instead of the oldest."""
    hashes = [(1 << 40) + i for i in range(5)]  # same msgpack int width: same file size
    probe = HostKVTier(
        byte_budget=block_bytes(), spill_dir=tmp_path / "probe", spill_budget=1 << 20
    )
    probe.put("L", hashes[:2], [make_block(h) for h in hashes[:2]])
    file_size = probe.stats()["spilled_bytes"]
    tier = HostKVTier(
        block_bytes(), tmp_path / "spill", spill_budget=2 * file_size + file_size // 2
    )
    for h in hashes:
        tier.put("L", [h], [make_block(h)])
    # Memory holds the last; disk the two before it; the two oldest are gone.
    assert [tier.lookup("L", [h]) for h in hashes] == [0, 0, 1, 1, 1]
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == [
        f"L-{h:016x}.kvblock" for h in hashes[2:4]
    ]
    assert tier.stats()["spilled_bytes"] == 2 * file_size
    assert_bitwise(tier.get("L", [hashes[2]])[0], make_block(hashes[2]))


def test_a_corrupt_spill_file_is_reported_and_forgotten(tmp_path):
    """A truncated spill file returned as a short tensor, or looked up again and again."""
    tier = HostKVTier(block_bytes(), tmp_path, spill_budget=1 << 20)
    tier.put("L", [1, 2], [make_block(1), make_block(2)])  # 2 is spilled (chain tail first)
    path = tmp_path / f"L-{2:016x}.kvblock"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="truncated"):
        tier.get("L", [1, 2])
    assert tier.lookup("L", [1, 2]) == 1 and not path.exists()


def test_layout_hashes_do_not_mix():
    """Blocks of one model (or dtype) served to another because the block hashes agree."""
    tier = HostKVTier(byte_budget=1 << 20)
    a, b = make_block(1), make_block(2, (torch.float32,))
    tier.put("modelA", [7], [a])
    tier.put("modelB", [7], [b])
    assert_bitwise(tier.get("modelA", [7])[0], a)
    assert_bitwise(tier.get("modelB", [7])[0], b)
    assert tier.lookup("modelC", [7]) == 0


def test_bad_input_is_refused_and_nothing_is_stored(tmp_path):
    """An oversize block evicting everything and then breaking the budget; a layout hash
    escaping the spill dir; a half-applied put."""
    tier = HostKVTier(byte_budget=block_bytes(), spill_dir=tmp_path, spill_budget=1 << 20)
    with pytest.raises(ValueError, match="over the tier's byte_budget"):
        tier.put("L", [1, 2], [make_block(1), make_block(2, (torch.float32,) * 2)])
    with pytest.raises(ValueError, match="layout_hash must match"):
        tier.put("../etc", [1], [make_block(1)])
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        tier.lookup("L", [-1])
    with pytest.raises(ValueError, match="2 block hashes but 1 blocks"):
        tier.put("L", [1, 2], [make_block(1)])
    with pytest.raises(ValueError, match="non-empty tuple of tensors"):
        tier.put("L", [1], [list(make_block(1))])
    assert tier.stats()["num_blocks"] == 0 and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="needs a spill_dir"):
        HostKVTier(byte_budget=1, spill_budget=10)


def test_concurrent_put_get_stays_consistent(tmp_path):
    """Lost updates or torn state under threads: bytes over budget, a get returning another
    hash's block, the index and the spill dir disagreeing."""
    b = block_bytes()
    tier = HostKVTier(byte_budget=12 * b, spill_dir=tmp_path, spill_budget=20 * (b + 200))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                hashes = rng.sample(range(40), rng.randint(1, 4))
                tier.put("L", hashes, [make_block(h) for h in hashes])
                try:
                    got = tier.get("L", hashes)
                except KeyError:
                    continue  # evicted by another thread in between: allowed
                for h, block in zip(hashes, got):
                    assert_bitwise(block, make_block(h))
                assert tier.stats()["bytes"] <= 12 * b
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert errors == []
    stats = tier.stats()
    assert stats["bytes"] == stats["num_blocks"] * b <= 12 * b
    files = list(tmp_path.iterdir())
    assert len(files) == stats["spilled_blocks"]
    assert sum(p.stat().st_size for p in files) == stats["spilled_bytes"] <= 20 * (b + 200)
    present = [h for h in range(40) if tier.lookup("L", [h])]
    assert len(present) == stats["num_blocks"] + stats["spilled_blocks"]
    for h, block in zip(present, tier.get("L", present)):
        assert_bitwise(block, make_block(h))

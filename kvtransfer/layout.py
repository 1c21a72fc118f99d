"""KV layout descriptors: the geometry of a worker's KV storage, and the handshake check.

A layout is a model name plus one or more groups; a hybrid model (attention layers and
Mamba layers) has several. A group knows the shape of one unit of transfer per layer (a
paged block, or a request slot's final Mamba state), its dtypes, and how to allocate a
storage of `[num_layers, num_units, *unit_shape]` per tensor, the layer axis outside the
unit axis so one unit across all layers is `num_layers` strided chunks (DESIGN §4). The
runner's paged cache (`runner.mrv2.kv_cache`) is exactly a `paged_gqa` storage.

Peers exchange `KVLayout.to_wire()` at handshake; `check_compatible` refuses a mismatch
with a message naming each differing field and both values, and `compat_hash` is a short
form for logs and caches.

What this module does not know: which units belong to a request (the block table does),
how units are packed (`kvtransfer.pack`) or how bytes travel (the transports).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch

LAYOUT_VERSION = 1

# Names are torch's without "torch.", so a wire dict never carries a Python object.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class LayoutMismatch(ValueError):
    """Two peers' KV layouts differ; the message names every differing field."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field(field: str, annotation: str, value: object) -> None:
    """Fields are checked by their annotation: ints positive, shapes non-empty tuples of
    positive ints, `*dtype` strs known, other strs (names) non-empty."""
    if annotation == "int":
        ok, rule = _is_int(value) and value > 0, "a positive int"
    elif annotation == "tuple[int, ...]":
        ok = isinstance(value, tuple) and bool(value) and all(_is_int(x) and x > 0 for x in value)
        rule = "a non-empty tuple of positive ints"
    elif field.endswith("dtype"):
        ok = isinstance(value, str) and value in DTYPES
        rule = f"one of {sorted(DTYPES)} (torch names without 'torch.')"
    else:
        ok, rule = isinstance(value, str) and bool(value), "a non-empty str"
    if not ok:
        raise ValueError(f"{field} must be {rule}, got {value!r}")


# What a wire value must be, by the field's annotation (a string under postponed
# evaluation); tuples travel as msgpack arrays and come back as lists.
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "tuple[int, ...]": (list, tuple),
}


class _GroupBase:
    """Methods shared by the group dataclasses; each subclass gives its unit shapes/dtypes."""

    kind: ClassVar[str]
    name: str
    num_layers: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_field(f.name, str(f.type), getattr(self, f.name))

    def unit_shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def tensor_dtypes(self) -> tuple[torch.dtype, ...]:
        raise NotImplementedError

    def unit_elems(self) -> tuple[int, ...]:
        """Elements of one unit in one layer, per tensor (the E of a `[L, NU, E]` view)."""
        return tuple(math.prod(shape) for shape in self.unit_shapes())

    def unit_bytes(self) -> int:
        """Bytes of one unit across all layers and tensors."""
        per_layer = sum(
            e * dt.itemsize for e, dt in zip(self.unit_elems(), self.tensor_dtypes(), strict=True)
        )
        return self.num_layers * per_layer

    def allocate(self, num_units: int, device: torch.device | str = "cpu") -> GroupStorage:
        """Zero-filled storage of `num_units` units."""
        if not _is_int(num_units) or num_units < 0:
            raise ValueError(f"num_units must be a non-negative int, got {num_units!r}")
        tensors = tuple(
            torch.zeros((self.num_layers, num_units, *shape), dtype=dt, device=device)
            for shape, dt in zip(self.unit_shapes(), self.tensor_dtypes(), strict=True)
        )
        return GroupStorage(self, tensors)  # type: ignore[arg-type]

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            wire[f.name] = list(value) if isinstance(value, tuple) else value
        return wire

    @classmethod
    def from_wire(cls, wire: object) -> Any:
        if not isinstance(wire, dict):
            raise ValueError(f"a {cls.kind} group must be a dict, got {type(wire).__name__}")
        if wire.get("kind") != cls.kind:
            raise ValueError(f"kind: expected {cls.kind!r}, got {wire.get('kind')!r}")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        missing = sorted(set(fields) - set(wire))
        if missing:
            raise ValueError(f"{cls.kind} group is missing field(s) {missing}")
        unknown = sorted(set(wire) - set(fields) - {"kind"}, key=str)
        if unknown:
            raise ValueError(f"{cls.kind} group has unknown field(s) {unknown}")
        kwargs = {}
        for name, annotation in fields.items():
            value = wire[name]
            allowed = _WIRE_TYPES[str(annotation)]
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ValueError(
                    f"{cls.kind} group field {name!r} must be {annotation}, "
                    f"got {type(value).__name__} {value!r}"
                )
            kwargs[name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)  # __post_init__ checks values, naming the field


@dataclass(frozen=True)
class PagedGQAGroup(_GroupBase):
    """Paged K/V of grouped-query attention; one tensor `[L, num_blocks, 2, bs, H, D]`."""

    kind: ClassVar[str] = "paged_gqa"
    name: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def unit_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((2, self.block_size, self.num_kv_heads, self.head_dim),)

    def tensor_dtypes(self) -> tuple[torch.dtype, ...]:
        return (DTYPES[self.dtype],)


@dataclass(frozen=True)
class PagedMLAGroup(_GroupBase):
    """Paged MLA latent (one per token, no heads); one tensor `[L, num_blocks, bs, r + rope]`."""

    kind: ClassVar[str] = "paged_mla"
    name: str
    num_layers: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str

    def unit_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.block_size, self.kv_lora_rank + self.rope_dim),)

    def tensor_dtypes(self) -> tuple[torch.dtype, ...]:
        return (DTYPES[self.dtype],)


@dataclass(frozen=True)
class MambaStateGroup(_GroupBase):
    """A request slot's final Mamba state: conv `[L, max_reqs, *conv]`, ssm `[L, max_reqs, *ssm]`."""

    kind: ClassVar[str] = "mamba_state"
    name: str
    num_layers: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: str
    ssm_dtype: str

    def unit_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.conv_shape, self.ssm_shape)

    def tensor_dtypes(self) -> tuple[torch.dtype, ...]:
        return (DTYPES[self.conv_dtype], DTYPES[self.ssm_dtype])


Group = PagedGQAGroup | PagedMLAGroup | MambaStateGroup
GROUP_TYPES: dict[str, type[Group]] = {
    cls.kind: cls for cls in (PagedGQAGroup, PagedMLAGroup, MambaStateGroup)
}


def group_from_wire(wire: object) -> Group:
    kind = wire.get("kind") if isinstance(wire, dict) else None
    if not isinstance(kind, str) or kind not in GROUP_TYPES:
        raise ValueError(f"kind must be one of {sorted(GROUP_TYPES)}, got {kind!r}")
    return GROUP_TYPES[kind].from_wire(wire)


@dataclass(frozen=True, eq=False)
class GroupStorage:
    """A group's tensors, each `[num_layers, num_units, *unit_shape]`, dense below the layer
    axis (the layer stride may be larger: a range of units of a bigger cache is allowed)."""

    group: Group
    tensors: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if isinstance(self.tensors, list):
            object.__setattr__(self, "tensors", tuple(self.tensors))
        g = self.group
        shapes, dtypes = g.unit_shapes(), g.tensor_dtypes()
        where = f"{g.kind} group {g.name!r}"
        if len(self.tensors) != len(shapes):
            raise ValueError(f"{where} has {len(shapes)} tensor(s), got {len(self.tensors)}")
        first = self.tensors[0]
        num_units = first.shape[1] if first.dim() > 1 else -1
        for i, (t, shape, dtype) in enumerate(zip(self.tensors, shapes, dtypes, strict=True)):
            want = (g.num_layers, num_units, *shape)
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{where} tensor {i}: shape {tuple(t.shape)}, expected "
                    f"[num_layers, num_units, *unit_shape] = {list(want)}"
                )
            if t.dtype != dtype:
                raise ValueError(f"{where} tensor {i}: dtype {t.dtype}, expected {dtype}")
            if t.device != first.device:
                raise ValueError(f"{where} tensor {i} is on {t.device}, tensor 0 on {first.device}")
            if not t[0].is_contiguous():
                raise ValueError(
                    f"{where} tensor {i} must be dense below the layer axis, strides {t.stride()}"
                )
        # Made once: a pull reads them on every call, and the copy kernel's launch set-up
        # is kept per pair of these very views (kernels/kv_copy.PairCache).
        flat = tuple(
            t.view(t.shape[0], t.shape[1], e)
            for t, e in zip(self.tensors, g.unit_elems(), strict=True)
        )
        object.__setattr__(self, "_flat", flat)
        # Read several times a pull; a tensor's `.device` builds a new object per call.
        object.__setattr__(self, "_device", first.device)

    @property
    def num_units(self) -> int:
        return self.tensors[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self._device  # type: ignore[attr-defined]

    def flat(self) -> tuple[torch.Tensor, ...]:
        """Each tensor as a `[num_layers, num_units, E]` view (same memory, no copy)."""
        return self._flat  # type: ignore[attr-defined]


@dataclass(frozen=True)
class KVLayout:
    """A worker's KV geometry: one group, or several for a hybrid model."""

    model: str
    groups: tuple[Group, ...]
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.groups, list):
            object.__setattr__(self, "groups", tuple(self.groups))
        _check_field("model", "str", self.model)
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(f"groups must be a non-empty tuple of groups, got {self.groups!r}")
        for i, g in enumerate(self.groups):
            if not isinstance(g, tuple(GROUP_TYPES.values())):
                raise ValueError(f"groups[{i}] must be a group, got {type(g).__name__}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        _check_field("version", "int", self.version)

    def compat_hash(self) -> str:
        """Hex sha256 of a canonical msgpack encoding (sorted keys); same in every process."""
        groups = [dict(sorted(g.to_wire().items())) for g in self.groups]
        payload = msgpack.packb([self.version, self.model, groups], use_bin_type=True)
        return hashlib.sha256(payload).hexdigest()

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.model,
            "groups": [g.to_wire() for g in self.groups],
        }

    @classmethod
    def from_wire(cls, wire: object) -> KVLayout:
        if not isinstance(wire, dict):
            raise ValueError(f"a KV layout must be a dict, got {type(wire).__name__}")
        keys = {"version", "model", "groups"}
        if set(wire) != keys:
            raise ValueError(
                f"a KV layout has exactly the fields {sorted(keys)}: missing "
                f"{sorted(keys - set(wire))}, unknown {sorted(set(wire) - keys, key=str)}"
            )
        for key, allowed, rule in (
            ("version", int, "int"),
            ("model", str, "str"),
            ("groups", list | tuple, "a list"),
        ):
            if isinstance(wire[key], bool) or not isinstance(wire[key], allowed):
                raise ValueError(f"field {key!r} must be {rule}, got {wire[key]!r}")
        groups = []
        for i, g in enumerate(wire["groups"]):
            try:
                groups.append(group_from_wire(g))
            except ValueError as e:
                raise ValueError(f"groups[{i}]: {e}") from e
        return cls(model=wire["model"], groups=tuple(groups), version=wire["version"])

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch naming every field that differs (here vs the peer)."""
        diffs: list[str] = []

        def differ(what: str, here: object, peer: object) -> None:
            diffs.append(f"{what}: {here!r} here vs {peer!r} on the peer")

        if self.version != other.version:
            differ("layout version", self.version, other.version)
        if self.model != other.model:
            differ("model", self.model, other.model)
        if len(self.groups) != len(other.groups):
            differ("number of groups", len(self.groups), len(other.groups))
        for i, (mine, theirs) in enumerate(zip(self.groups, other.groups)):
            label = f"group {i} {mine.name!r}"
            if mine.kind != theirs.kind:
                differ(f"{label} kind", mine.kind, theirs.kind)
                continue
            for f in dataclasses.fields(mine):
                here, peer = getattr(mine, f.name), getattr(theirs, f.name)
                if here != peer:
                    differ(f"{label} {f.name}", here, peer)
        if diffs:
            raise LayoutMismatch("KV layout mismatch: " + "; ".join(diffs))


def gqa_layout_for(
    model_name: str,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> KVLayout:
    """The layout of the runner's paged cache: one `paged_gqa` group named "kv"."""
    dtype_name = str(dtype).removeprefix("torch.")
    group = PagedGQAGroup("kv", num_layers, block_size, num_kv_heads, head_dim, dtype_name)
    return KVLayout(model=model_name, groups=(group,))


def paged_cache_storage(
    model_name: str, kv_cache: torch.Tensor, kv_lora_rank: int | None = None
) -> tuple[KVLayout, GroupStorage]:
    """Layout and storage of a runner's paged cache: `[L, num_blocks, 2, bs, H, D]` (one
    `paged_gqa` group), or with `kv_lora_rank` an MLA model's `[L, num_blocks, bs, r + rope]`
    (one `paged_mla` group)."""
    if kv_lora_rank is not None:
        num_layers, _, block_size, width = kv_cache.shape
        assert width > kv_lora_rank, f"MLA rows of {width} must be wider than r={kv_lora_rank}"
        dtype_name = str(kv_cache.dtype).removeprefix("torch.")
        group = PagedMLAGroup(
            "kv", num_layers, block_size, kv_lora_rank, width - kv_lora_rank, dtype_name
        )
        return KVLayout(model=model_name, groups=(group,)), GroupStorage(group, (kv_cache,))
    num_layers, _, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert two == 2, f"not a paged K/V cache: shape {tuple(kv_cache.shape)}"
    layout = gqa_layout_for(
        model_name, num_layers, block_size, num_kv_heads, head_dim, kv_cache.dtype
    )
    return layout, GroupStorage(layout.groups[0], (kv_cache,))


def worker_storage(
    model_name: str,
    kv_cache: torch.Tensor,
    kv_lora_rank: int | None = None,
    mamba_states: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[KVLayout, tuple[GroupStorage, ...]]:
    """Layout and storages of a worker's KV: the paged cache (`paged_cache_storage`), and
    for a hybrid Mamba model a second group, "mamba", over its state units: conv
    `[L, units, K-1, conv_dim]` and ssm `[L, units, heads, head_dim, state]`
    (runner/mrv2/mamba_state.py), one unit a request."""
    layout, storage = paged_cache_storage(model_name, kv_cache, kv_lora_rank)
    if mamba_states is None:
        return layout, (storage,)
    conv, ssm = mamba_states
    group = MambaStateGroup(
        "mamba", conv.shape[0], tuple(conv.shape[2:]), tuple(ssm.shape[2:]),
        str(conv.dtype).removeprefix("torch."), str(ssm.dtype).removeprefix("torch."),
    )  # fmt: skip
    layout = KVLayout(model=model_name, groups=(*layout.groups, group))
    return layout, (storage, GroupStorage(group, (conv, ssm)))

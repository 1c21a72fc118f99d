"""The LoRA adapters a server serves (`--lora-modules`, and vLLM's runtime
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter`): name -> the adapter's key and folder.

The router owns the registry and sends each request's adapter key and folder on the wire
(cluster/wire.py), so a worker needs no list of its own: one that starts or restarts
later runs whatever the registry names, and loads an adapter into a slot when a request
first names it (runner/lora/).

The key is what workers run the adapter as: its slot and the root its prompts' block
hashes chain from (runner/block_hash.py), in the workers' caches, the router's prefix index
and the KV tier alike. An adapter given at start is keyed by its name; one loaded at run
time under a name keyed before gets a key of its own (`name@n`), so an adapter unloaded and
loaded again under the same name, maybe from other weights, never meets the cached KV of
the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedAdapter:
    name: str  # what a request's `model` names
    key: str  # what workers run it as (its slot, its block-hash root)
    path: str  # its PEFT folder


class LoraRegistry:
    def __init__(self) -> None:
        self._by_name: dict[str, ServedAdapter] = {}
        self._names: dict[str, str] = {}  # every key ever given -> its name
        self._loads = 0

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> ServedAdapter | None:
        return None if name is None else self._by_name.get(name)

    def adapters(self) -> list[ServedAdapter]:
        return list(self._by_name.values())

    def add(self, name: str, path: str) -> ServedAdapter:
        """Serve an adapter under `name` (the caller checked its files): keyed by its name
        unless some adapter had that key before."""
        assert name not in self._by_name, name
        key = name
        while key in self._names:  # every key this registry ever gave is kept
            self._loads += 1
            key = f"{name}@{self._loads}"
        adapter = ServedAdapter(name, key, path)
        self._by_name[name] = adapter
        self._names[key] = name
        return adapter

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name`; requests already running with it finish. Its key stays
        known (`served_name`) and is never given again."""
        return self._by_name.pop(name)

    def served_name(self, key: str) -> str:
        """The name an adapter key was served under (/metrics speaks names)."""
        return self._names.get(key, key)

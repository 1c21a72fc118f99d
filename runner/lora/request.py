"""vLLM's `LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's name (the `model` an API request names)
    lora_int_id: int  # vLLM's unique id, > 0; pdserve keys adapters by name
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(f"lora_name must be a non-empty string (got {self.lora_name!r})")
        if not (isinstance(self.lora_int_id, int) and self.lora_int_id > 0):
            raise ValueError(f"lora_int_id must be a positive integer (got {self.lora_int_id!r})")
        if not (isinstance(self.lora_path, str) and self.lora_path):
            raise ValueError(f"lora_path must be a folder path (got {self.lora_path!r})")

"""LoRA adapters served beside the base weights (vLLM's `enable_lora`): read from PEFT
folders (adapter.py), held in per-projection device stacks, one slot per adapter, and
applied per token by the slot its request chose (slots.py)."""

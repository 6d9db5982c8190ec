"""Multi-LoRA serving: PEFT adapters read and checked (ipc/lora_adapter.py, adapter_files.py), a
pool of `max_loras` device slots per adapted linear layer (adapter_pool.py), and the layers that add
each row's adapter to the base output, grouped by slot (lora_layers.py). See docs/lora.md."""

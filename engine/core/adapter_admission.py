"""Which LoRA adapters a step may hold: at most `max_loras` distinct ones among the running
requests (the device pool has that many slots, engine/lora/adapter_pool.py). A waiting request
whose adapter would be one too many stops admission, as a request that finds no blocks does:
first come, first served across adapters, so a request for a new adapter goes in as soon as
one running adapter's requests drain, and later requests for running adapters never pass it."""

from __future__ import annotations

from engine.core.request import Request

NO_ADAPTER = 0  # the base model's adapter id (LoRARequest ids start at 1)


def adapter_id(request: Request) -> int:
    return NO_ADAPTER if request.lora_request is None else request.lora_request.lora_int_id


def running_adapters(running: list[Request]) -> set[int]:
    return {adapter_id(r) for r in running} - {NO_ADAPTER}


def fits_adapters(request: Request, adapters: set[int], max_loras: int) -> bool:
    """Whether `request` may run beside the running `adapters` (updated when it may)."""
    lora_id = adapter_id(request)
    if lora_id == NO_ADAPTER or lora_id in adapters:
        return True
    if len(adapters) >= max_loras:
        return False
    adapters.add(lora_id)
    return True

"""The engine core's loop (vLLM V1's vllm/v1/engine/core.py): `EngineCore` (engine_core.py) builds the
parts a config names (batching.py picks the scheduler and runner) and steps them, schedule ->
execute -> update; `core_process.py` is its process, a busy loop over ipc messages. The top floor
of the engine: it imports the rooms below, and none of them imports it."""

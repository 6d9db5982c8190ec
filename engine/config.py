"""Engine configuration: `EngineConfig` is declared in `ipc.engine_config`, beside the
command-line flags built from its fields, because the frontend starts cores with them.
Imported from here by the engine's own modules."""

from ipc.engine_config import BATCHING_MODES, DEFAULT_MODEL, EngineConfig

__all__ = ["BATCHING_MODES", "DEFAULT_MODEL", "EngineConfig"]

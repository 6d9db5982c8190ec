"""LoRA adapters on the server, in vLLM's names: the registry of adapter names a request's `model`
may pick (from --lora-modules at start, and at run time under --allow-runtime-lora-updating), and

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"}   checked here (ipc.lora_adapter) before it is served
    POST /v1/unload_lora_adapter   {"lora_name"}                requests running on it finish on it; new ones get 404

Adapters are only names and paths here: each core loads an adapter the first time a request names
it and keeps at most --max-cpu-loras (engine/lora/), so a flood of loads costs a header read each.
The route handler resolves `model` to the request's adapter (`resolve`) and hands it to the engine
client through `requested_adapter`, a context variable of the request's own task.
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from frontend.errors import InvalidRequestError, ModelNotFoundError, NotFoundError
from ipc.lora_adapter import AdapterSpec, ModelShape, check_adapter, check_max_lora_rank
from ipc.messages import LoRARequest

MAX_ADAPTER_NAMES = 1024  # names registered at once: each is a path and a checked header, loaded lazily
DEFAULT_MAX_LORA_RANK = 16  # EngineConfig's; the frontend's flags are unset unless given
# The adapter the current request's `model` picked (None: the base), read by AsyncEngineClient.generate_batch.
requested_adapter: ContextVar[LoRARequest | None] = ContextVar("requested_adapter", default=None)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


class LoRARegistry:
    def __init__(self, base_name: str, model_folder: str | None = None, is_enabled: bool = False,
                 max_lora_rank: int = DEFAULT_MAX_LORA_RANK, allow_updates: bool = False) -> None:
        self.base_name = base_name
        self.shape = ModelShape.from_folder(model_folder) if is_enabled else None
        self.is_enabled = is_enabled
        self.max_lora_rank = max_lora_rank
        self.allow_updates = allow_updates
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}  # an adapter's base_model_name where --lora-modules gave one
        self._next_id = 1  # ids are never reused: a reloaded name is a new adapter to the cores' caches

    @classmethod
    def from_args(cls, args, base_name: str, model_folder: str) -> "LoRARegistry":
        """The registry of --enable-lora, --lora-modules and --allow-runtime-lora-updating (ValueError naming the flag)."""
        max_rank = args.max_lora_rank or DEFAULT_MAX_LORA_RANK
        check_max_lora_rank(max_rank)
        modules = args.lora_modules or []
        if (modules or args.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        registry = cls(base_name, model_folder, bool(args.enable_lora), max_rank, args.allow_runtime_lora_updating)
        for module in modules:
            name, path, parent = parse_lora_module(module)
            try:
                registry.add(name, path)
            except InvalidRequestError as e:
                raise ValueError(f"--lora-modules {module!r}: {e}") from None
            if parent:
                registry.parents[name] = parent
        return registry

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base (or no name); 404 for any other name."""
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        return adapter

    def add(self, name: str, path: str, spec: AdapterSpec | None = None) -> LoRARequest:
        """Register adapter `name` at `path` (`spec`: its check, made already); a 400 naming the field."""
        self.check_name(name)
        spec = spec or self.check_path(path)
        adapter = LoRARequest(name, self._next_id, spec.path)
        self._next_id += 1
        self.adapters[name] = adapter
        return adapter

    def check_name(self, name: str) -> None:
        if not self.is_enabled:
            raise InvalidRequestError("LoRA adapters are off: start the server with --enable-lora")
        if not name or len(name) > 256 or name.strip() != name:
            raise InvalidRequestError("lora_name must be 1 to 256 characters, without surrounding spaces")
        if name == self.base_name or name in self.adapters:
            raise InvalidRequestError(f"lora_name {name!r} is already served; unload it first or pick another name")
        if len(self.adapters) >= MAX_ADAPTER_NAMES:
            raise InvalidRequestError(f"{MAX_ADAPTER_NAMES} adapters are loaded already; unload some first")

    def check_path(self, path: str) -> AdapterSpec:
        try:
            return check_adapter(path, self.shape, self.max_lora_rank)
        except (ValueError, OSError) as e:
            raise InvalidRequestError(f"lora_path: {e}") from None

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise NotFoundError(f"lora_name: the LoRA adapter `{name}` is not loaded")
        self.parents.pop(name, None)

    def model_cards(self, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "tokenloom", "root": a.lora_path,
                 "parent": self.parents.get(name, self.base_name)} for name, a in self.adapters.items()]


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """`name=path`, or vLLM's JSON form {"name", "path", "base_model_name"}: (name, path, base model or None)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs \"name\" and \"path\" strings")
        return spec["name"], spec["path"], spec.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return name, path, None


def add_lora_routes(app: FastAPI, registry: LoRARegistry, read_body) -> None:
    """The runtime routes; while --allow-runtime-lora-updating is off they answer 400 naming it."""

    def check_allowed() -> None:
        if not registry.allow_updates:
            raise InvalidRequestError("loading and unloading LoRA adapters at run time is off: start the server "
                                      "with --enable-lora --allow-runtime-lora-updating")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> PlainTextResponse:
        check_allowed()
        body = await read_body(raw_request, LoadLoRAAdapterRequest)
        registry.check_name(body.lora_name)
        # A header read and a few stats, off the event loop: the streams go on meanwhile.
        spec = await asyncio.get_running_loop().run_in_executor(None, registry.check_path, body.lora_path)
        registry.add(body.lora_name, body.lora_path, spec)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> PlainTextResponse:
        check_allowed()
        body = await read_body(raw_request, UnloadLoRAAdapterRequest)
        registry.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


"""A machine's step-cost parameters: peak rates from a spec sheet (or a micro-benchmark),
an efficiency factor for each, the memory left for the KV pool, and the engine's own
per-step overheads.

Profiles are JSON files. The GPU ones ship in `profiles/` and cite their spec sheets in
`source`; `calibrated` is this machine's, written by `scripts/simulate/run.py --calibrate`
to `$TOKENLOOM_CACHE/simulator/calibrated.json` (the CPU changes between sessions, so
it records the CPU model and dtype it was fitted on and must be refitted on another).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine.cpu.host import cache_dir, cpu_name

logger = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
CALIBRATED = "calibrated"


@dataclass
class HardwareProfile:
    name: str
    source: str  # where each number comes from: spec sheet, measurement or fit
    matmul_flops_per_s: dict[str, float]  # peak dense matmul rate per dtype name, per device
    memory_bandwidth_bytes_per_s: float  # per device
    # Achieved over peak. Matmuls: large GEMMs reach 60-80% of a GPU's tensor peak;
    # streaming reads 80-90% of HBM bandwidth.
    matmul_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0  # weight reads
    kv_read_efficiency: float = 1.0  # paged KV gathers reach less than a straight stream
    attention_efficiency: float = 1.0  # attention FLOPs, against the matmul peak
    # True: a step's memory and arithmetic overlap (roofline max, GPUs); False: they add
    # up (this CPU, where the same two cores both stream weights and multiply).
    overlap: bool = True
    memory_bytes: int = 0  # per device
    memory_utilization: float = 0.9  # share of memory_bytes for weights + KV pool (vLLM's default)
    kv_cache_memory_bytes: int | None = None  # set: the KV pool's size per device, whatever the weights
    link_bandwidth_bytes_per_s: float = 0.0  # one direction, per device (tensor-parallel all-reduce)
    link_latency_s: float = 0.0  # per all-reduce
    # The engine's own work, outside the model: scheduling, building inputs, sampling,
    # sending outputs.
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0  # per sequence in the step
    request_overhead_s: float = 0.0  # per request, once, at arrival (checks, detokenizer set-up)
    # Served through the HTTP server, a step takes this many times its offline price (here
    # the frontend and the client share the CPU with the core), and each token reaches the
    # client this much later (HTTP, tokenizer, IPC, detokenizer, SSE).
    server_step_factor: float = 1.0
    server_latency_s: float = 0.0
    cpu_model: str | None = None  # calibrated profiles: what they were fitted on
    dtype: str | None = None  # calibrated profiles: the dtype the fit ran in; GPUs: None (any)
    fit: dict = field(default_factory=dict)  # calibrated profiles: residuals, step counts, inputs

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.matmul_flops_per_s:
            raise ValueError(f"profile {self.name!r} has no matmul rate for {dtype}; it has "
                             f"{sorted(self.matmul_flops_per_s)}")
        return self.matmul_flops_per_s[dtype]

    def kv_pool_bytes(self, weight_bytes_per_device: int) -> int:
        """Bytes per device for the KV pool: given outright, or what the weights leave of
        `memory_utilization` (activations are small next to a 7B model's weights)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        pool = int(self.memory_bytes * self.memory_utilization) - weight_bytes_per_device
        if pool <= 0:
            raise ValueError(f"the weights ({weight_bytes_per_device / 1e9:.1f} GB per device) leave no KV pool "
                             f"in {self.name}'s {self.memory_bytes / 1e9:.0f} GB; raise --tensor-parallel-size")
        return pool

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        return cls(**data)


def calibrated_profile_path() -> Path:
    return cache_dir() / "simulator" / f"{CALIBRATED}.json"


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json")) + [CALIBRATED]


def load_profile(name_or_path: str) -> HardwareProfile:
    """`calibrated`, a shipped profile's name (h100-sxm, ...), or a profile JSON file."""
    if name_or_path == CALIBRATED:
        path = calibrated_profile_path()
        if not path.is_file():
            raise FileNotFoundError(f"no calibrated profile at {path}: run python -m scripts.simulate.run --calibrate first")
    elif (PROFILES_DIR / f"{name_or_path}.json").is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"unknown hardware profile {name_or_path!r}: not one of {profile_names()} "
                                    "and not a file")
    profile = HardwareProfile.from_dict(json.loads(path.read_text()))
    if profile.cpu_model is not None:

        if profile.cpu_model != cpu_name():
            logger.warning("profile %s was fitted on %r, this machine is %r: recalibrate for predictions here",
                           path, profile.cpu_model, cpu_name())
    return profile

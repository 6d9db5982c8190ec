"""A PEFT LoRA adapter's folder read and checked against a model, torch-free: written once, run
where an adapter enters (the frontend's --lora-modules and /v1/load_lora_adapter, and the engine
core, which then loads the tensors: engine/lora/adapter_files.py).

The folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors`, whose keys PEFT writes as

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight    [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight    [out, r]

Only the safetensors header is read here (its JSON: names, dtypes, shapes), never the data.
Our layers fuse q/k/v into one qkv_proj and gate/up into one gate_up_proj, for every family;
a Llama-style adapter's q_proj is then the q part of qkv_proj, a Phi-3 adapter's qkv_proj
(already fused in its checkpoint) the whole of it. Every failure is a ValueError naming the
field or file, which the frontend answers with a 400.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

LORA_RANKS = (8, 16, 32, 64)  # --max-lora-rank's choices, as vLLM's
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}
# PEFT's module names -> (our module, the part of its output they are). None: the whole output.
SEPARATE = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
            "down_proj": ("down_proj", None)}
FUSED = {"qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", None), "gate_up_proj": ("gate_up_proj", None),
         "down_proj": ("down_proj", None)}
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)  # q/k/v and gate/up already fused in the checkpoint
MLP_MODULES = ("gate_up_proj", "down_proj")
PART_INDEX = {None: 0, "q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
NUM_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # rank blocks per pool slot
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's shapes are checked against, from the model's config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int
    is_moe: bool  # the MLP is experts: no dense gate/up/down to adapt

    @classmethod
    def from_folder(cls, model_path: str) -> "ModelShape":
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        return cls(architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
                   num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], q_size=num_heads * head_dim,
                   kv_size=cfg.get("num_key_value_heads", num_heads) * head_dim,
                   is_moe=bool(cfg.get("num_experts") or cfg.get("num_local_experts")))

    @property
    def module_names(self) -> dict[str, tuple[str, str | None]]:
        """The PEFT target modules this model has, and where each lands in ours."""
        names = FUSED if self.architecture in FUSED_ARCHITECTURES else SEPARATE
        return {k: v for k, v in names.items() if not (self.is_moe and v[0] in MLP_MODULES)}

    def in_features(self, module: str) -> int:
        return {"qkv_proj": self.hidden_size, "o_proj": self.q_size, "gate_up_proj": self.hidden_size,
                "down_proj": self.intermediate_size}[module]

    def out_slice(self, module: str, part: str | None) -> tuple[int, int]:
        """The rows of our module's output that `part` (None: all) writes."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        return {("qkv_proj", None): (0, q + 2 * kv), ("qkv_proj", "q"): (0, q), ("qkv_proj", "k"): (q, q + kv),
                ("qkv_proj", "v"): (q + kv, q + 2 * kv), ("o_proj", None): (0, self.hidden_size),
                ("gate_up_proj", None): (0, 2 * inter), ("gate_up_proj", "gate"): (0, inter),
                ("gate_up_proj", "up"): (inter, 2 * inter), ("down_proj", None): (0, self.hidden_size)}[(module, part)]


@dataclass(frozen=True)
class AdapterTensor:
    """One lora_A or lora_B tensor of the file and where it goes."""

    key: str  # its name in adapter_model.safetensors
    layer_index: int
    module: str  # ours: qkv_proj, o_proj, gate_up_proj, down_proj
    part: str | None  # q, k, v, gate, up; None: the module's whole output
    matrix: str  # "A" [rank, in] or "B" [out, rank]


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what engine/lora/adapter_files.py loads."""

    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA
    tensors: tuple[AdapterTensor, ...]

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)


def check_max_lora_rank(max_lora_rank: int) -> None:
    if max_lora_rank not in LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {max_lora_rank}")


def check_adapter(path: str, model: ModelShape, max_lora_rank: int) -> AdapterSpec:
    """Raise ValueError naming what is wrong with the adapter at `path` for `model`, or its spec."""
    try:
        return _check_adapter(path, model, max_lora_rank)
    except OSError as e:  # unreadable: a request's error, never the reader's crash
        raise ValueError(f"lora_path {path!r} cannot be read: {e.strerror or e}") from None


def _check_adapter(path: str, model: ModelShape, max_lora_rank: int) -> AdapterSpec:
    if not isinstance(path, str) or not path:
        raise ValueError("lora_path must be a non-empty path")
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a folder" + (" (no such path)" if not os.path.exists(path) else ""))
    config = _read_config(os.path.join(path, CONFIG_FILE))
    rank, scale = _check_config(config, model, max_lora_rank)
    header = read_safetensors_header(os.path.join(path, WEIGHTS_FILE))
    tensors = tuple(_check_tensor(key, entry, rank, model) for key, entry in header.items())
    if not tensors:
        raise ValueError(f"{WEIGHTS_FILE}: no LoRA tensors")
    pairs = {(t.layer_index, t.module, t.part, t.matrix) for t in tensors}
    for layer_index, module, part, matrix in pairs:
        other = "B" if matrix == "A" else "A"
        if (layer_index, module, part, other) not in pairs:
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer_index}'s {part or module} has lora_{matrix} "
                             f"without lora_{other}")
    return AdapterSpec(os.path.abspath(path), rank, scale, tensors)


def _read_config(config_path: str) -> dict:
    if not os.path.isfile(config_path):
        raise ValueError(f"the adapter has no {CONFIG_FILE}")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise ValueError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, model: ModelShape, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scale), or ValueError naming the config field."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not supported (LORA only)")
    if config.get("use_dora"):
        raise ValueError(f"{CONFIG_FILE}: use_dora: DoRA adapters are not supported (their magnitude vector "
                         "rescales each merged weight column, which an added low-rank product cannot express)")
    if config.get("modules_to_save"):
        raise ValueError(f"{CONFIG_FILE}: modules_to_save ({config['modules_to_save']}) is not supported: it "
                         "replaces whole base modules per adapter, which a shared base cannot serve")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise ValueError(f"{CONFIG_FILE}: {name} (a rank or alpha per module) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"{CONFIG_FILE}: bias: adapters that train biases are not supported (bias must be 'none')")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{CONFIG_FILE}: fan_in_fan_out (Conv1D layers) is not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{CONFIG_FILE}: r = {rank} is above max_lora_rank {max_lora_rank}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    known = model.module_names
    if isinstance(targets, list):
        lacking = sorted(str(t) for t in targets if t not in known)
        if lacking:
            raise ValueError(f"{CONFIG_FILE}: target_modules {lacking} are not modules of this model "
                             f"({model.architecture}) that LoRA can adapt: {sorted(known)}")
    elif targets is not None and not isinstance(targets, str):  # a str is PEFT's regex: the tensors tell
        raise ValueError(f"{CONFIG_FILE}: target_modules must be a list of module names")
    is_rslora = config.get("use_rslora", False)
    return rank, float(alpha) / (math.sqrt(rank) if is_rslora else rank)


def read_safetensors_header(weights_path: str) -> dict:
    """The header's tensor entries {name: {dtype, shape, data_offsets}}, checked against the file's size."""
    if not os.path.isfile(weights_path):
        raise ValueError(f"the adapter has no {WEIGHTS_FILE} (only safetensors weights are read)")
    size = os.path.getsize(weights_path)
    with open(weights_path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{WEIGHTS_FILE} is corrupt: shorter than its header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{WEIGHTS_FILE} is corrupt: a header of {header_len} bytes in a file of {size}")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{WEIGHTS_FILE} is corrupt: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{WEIGHTS_FILE} is corrupt: its header is not an object")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(v, int) for v in entry["shape"] + entry["data_offsets"]))
        if not ok or not 0 <= entry["data_offsets"][0] <= entry["data_offsets"][1] <= size - 8 - header_len:
            raise ValueError(f"{WEIGHTS_FILE} is corrupt: tensor {key!r}'s entry")
    return header


def _check_tensor(key: str, entry: dict, rank: int, model: ModelShape) -> AdapterTensor:
    if "lora_magnitude_vector" in key:
        raise ValueError(f"{WEIGHTS_FILE}: {key}: DoRA adapters are not supported")
    match = _KEY.match(key)
    if match is None:
        raise ValueError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA weight of a decoder layer's "
                         "q/k/v/o/gate/up/down projection (embeddings, the LM head and biases are not supported)")
    layer_index, name, matrix = int(match.group(1)), match.group(2), match.group(3)
    if name not in model.module_names:
        raise ValueError(f"{WEIGHTS_FILE}: {key}: this model ({model.architecture}) has no {name} "
                         f"that LoRA can adapt: {sorted(model.module_names)}")
    if layer_index >= model.num_layers:
        raise ValueError(f"{WEIGHTS_FILE}: {key}: layer {layer_index} is past the model's {model.num_layers}")
    if entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise ValueError(f"{WEIGHTS_FILE}: {key}: dtype {entry.get('dtype')!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
    module, part = model.module_names[name]
    start, end = model.out_slice(module, part)
    expected = [rank, model.in_features(module)] if matrix == "A" else [end - start, rank]
    if entry["shape"] != expected:
        raise ValueError(f"{WEIGHTS_FILE}: {key} has shape {entry['shape']}, this model needs {expected} "
                         "(an adapter made for another model?)")
    return AdapterTensor(key, layer_index, module, part, matrix)

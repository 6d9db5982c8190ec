"""Convert a GGUF file (llama.cpp's format) into a Hugging Face folder the engine loads.

    inspect_gguf(path)          metadata and tensor types; ValueError for a quantization
                                the gguf package cannot dequantize
    convert_gguf(path, out_dir) config.json, generation_config.json, model.safetensors,
                                tokenizer files, chat template, gguf_source.json

The architecture must be one transformers' GGUF loader reads and one the engine serves
(`engine.models.MODEL_CLASSES`); anything else is a ValueError naming it. Q4_0, Q4_1,
Q5_x, Q8_0, the K-quants, the IQ types, F16, BF16 and F32 all dequantize.

Weights are stored in fp32: the exact dequantized values, so the folder served in fp32
is the GGUF itself, and the engine casts to the served dtype as it loads. Past
FP32_FOLDER_MAX_BYTES (a model over ~1B parameters) fp32 would cost 4 bytes a
parameter on disk and in memory while converting (28 GB for a 7B), so such a model is
stored in 16 bits: float16 when its weights are F16 in the file (exact), bfloat16
otherwise (the CPU's served dtype; its rounding is far below a 4- or 8-bit quantization
step).

We call `load_gguf_checkpoint` rather than `AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)` because the latter insists on `accelerate`, which we do not depend on;
it is the same code path (dequantize, undo llama.cpp's q/k row permutation, rename).

References: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md,
transformers/modeling_gguf_pytorch_utils.py.
"""

import contextlib
import functools
import json
import logging
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Above this many bytes of fp32 weights (~1B parameters) the folder stores 16-bit weights.
FP32_FOLDER_MAX_BYTES = 4 << 30
# ggml types that hold plain values; every other one is a quantization (blocks).
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GgufInfo:
    """What the converter needs to know about a GGUF before reading its weights."""

    architecture: str  # general.architecture, in llama.cpp's spelling ("llama", "qwen2")
    tensor_types: dict[str, int]  # ggml type name ("Q4_1", "F32") -> number of tensors
    num_elements: int  # parameters in the file
    chat_template: str | None
    stop_token_ids: tuple[int, ...]  # eos, eot and eom ids llama.cpp stops on

    @property
    def weights_dtype(self) -> str:
        """The dtype model.safetensors is written in (module docstring)."""
        if self.num_elements * 4 <= FP32_FOLDER_MAX_BYTES:
            return "float32"
        return "float16" if set(self.tensor_types) - {"F32"} == {"F16"} else "bfloat16"


def inspect_gguf(gguf_path: Path) -> GgufInfo:
    """Read a GGUF's metadata and check that every tensor type can be dequantized.

    Raises ValueError naming the problem: not readable by the `gguf` package (an unknown
    tensor type or a newer format), or a quantization it cannot dequantize."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, KeyError) as error:
        raise ValueError(f"{gguf_path.name}: the gguf package (version {_gguf_version()}) cannot read it: {error}. "
                         "A tensor type or format version newer than it knows?") from error
    architecture = _read_field(reader, "general.architecture")
    if not reader.tensors or architecture is None:
        raise ValueError(f"{gguf_path.name}: no tensors or no general.architecture, not a model GGUF")
    readable = set(GGUF_FLOAT_TYPES)
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype.name in readable:
            continue
        rows = tensor.data.reshape(-1, tensor.data.shape[-1])[:1]  # one row is enough to find out
        try:
            gguf.dequantize(rows, qtype)
        except NotImplementedError as error:
            raise ValueError(
                f"{gguf_path.name}: tensor {tensor.name} is quantized as {qtype.name}, which the gguf package "
                f"(version {_gguf_version()}) cannot dequantize ({error}); use a file quantized as Q4_0, Q4_1, "
                "Q5_0, Q5_1, Q8_0, a K-quant (Q2_K-Q6_K), an IQ type, F16, BF16 or F32"
            ) from error
        readable.add(qtype.name)
    stop_ids = [_read_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    return GgufInfo(
        architecture=architecture,
        tensor_types=dict(Counter(tensor.tensor_type.name for tensor in reader.tensors)),
        num_elements=sum(int(tensor.n_elements) for tensor in reader.tensors),
        chat_template=_read_field(reader, "tokenizer.chat_template"),
        stop_token_ids=tuple(dict.fromkeys(i for i in stop_ids if i is not None)),
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF of an architecture the engine serves into an HF folder: weights
    (fp32 unless too large, see GgufInfo.weights_dtype), config, tokenizer, chat template."""
    info = inspect_gguf(gguf_path)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file_name = str(gguf_path.parent), gguf_path.name
    types = ", ".join(f"{count} {name}" for name, count in sorted(info.tensor_types.items()))
    logger.info("%s: %s, %.0fM parameters (%s tensors)", file_name, info.architecture, info.num_elements / 1e6, types)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{file_name}: transformers' GGUF loader cannot read architecture "
                         f"{info.architecture!r}: {error}") from error
    config.architectures = [_served_architecture(config, info, file_name)]
    dtype = getattr(torch, info.weights_dtype)
    needed = info.num_elements * dtype.itemsize
    if shutil.disk_usage(out_dir.parent).free < needed * 1.05:
        raise RuntimeError(f"{file_name}: converting needs {needed / 1e9:.1f} GB free in {out_dir.parent}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{file_name}: transformers cannot build a tokenizer from its metadata: {error}") from error

    # The meta-device model only supplies parameter names for the GGUF -> HF mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    logger.info("dequantizing %s to %s", file_name, info.weights_dtype)
    try:
        with memoized_tensor_name_maps():
            parsed = load_gguf_checkpoint(
                str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype
            )
    except NotImplementedError as error:
        raise ValueError(f"{file_name}: transformers cannot load its tensors: {error}") from error
    tensors = {name: t.to(dtype).contiguous() for name, t in parsed["tensors"].items()}
    _check_tensors(tensors, skeleton, config)

    out_dir.mkdir(parents=True)
    weights_path = out_dir / "model.safetensors"
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors writes 0600; the cache is shared
    _save_config(config, out_dir, info.weights_dtype)
    generation_config = GenerationConfig.from_model_config(config)
    stop_ids = list(dict.fromkeys([*_as_list(config.eos_token_id), *info.stop_token_ids]))
    if len(stop_ids) > 1:  # an end-of-turn token besides EOS: stop on both, as llama.cpp does
        generation_config.eos_token_id = stop_ids
    generation_config.save_pretrained(out_dir)

    if not tokenizer.chat_template:
        if info.chat_template is None:
            raise RuntimeError(f"{file_name} has no chat template")
        logger.info("restoring the chat template from GGUF metadata")
        tokenizer.chat_template = info.chat_template
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    source = {"file": file_name, "size": gguf_path.stat().st_size, "architecture": info.architecture,
              "tensor_types": info.tensor_types, "weights_dtype": info.weights_dtype}
    (out_dir / "gguf_source.json").write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")


def _served_architecture(config, info: GgufInfo, file_name: str) -> str:
    """The HF architecture name of `config`; ValueError unless the engine serves it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.models import MODEL_CLASSES  # imported here: it pulls in torch and the model code

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if not isinstance(architecture, str):
        architecture = f"{type(config).__name__.removesuffix('Config')}ForCausalLM"
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"{file_name}: GGUF architecture {info.architecture!r} is {architecture}, which "
                         f"tokenloom does not serve (it serves {', '.join(sorted(MODEL_CLASSES))})")
    return architecture


@contextlib.contextmanager
def replaced(module, name: str, value):
    """`module.name` is `value` inside the block, and what it was again after it."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def memoized_tensor_name_maps():
    """Memoize gguf.get_tensor_name_map during one conversion (a context manager). transformers'
    get_gguf_hf_weights_map builds a fresh TensorNameMap for every submodule it visits
    (~400 for SmolLM2, 10 of the conversion's 29 s); the map depends only on (arch, layers)."""
    import gguf

    return replaced(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


def _check_tensors(tensors: dict, skeleton, config) -> None:
    expected = dict(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # tied: shares model.embed_tokens.weight
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise RuntimeError(f"{name}: GGUF shape {tuple(tensor.shape)}, "
                               f"model expects {tuple(expected[name].shape)}")


def _save_config(config, out_dir: Path, weights_dtype: str) -> None:
    config.save_pretrained(out_dir)
    # Tidy what the GGUF leaves behind, for readers that parse config.json directly.
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    data["dtype"] = weights_dtype
    # GGUF stores eps as float32 (1e-5 -> 9.9999997e-06); print it as written upstream.
    if "rms_norm_eps" in data:
        data["rms_norm_eps"] = float(f"{data['rms_norm_eps']:.7g}")
    # transformers 5 writes rope_parameters; keep the older flat key too.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _read_field(reader, key: str):
    """A scalar GGUF metadata value (str, int, float), or None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"



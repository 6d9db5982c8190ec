"""A GGUF file (llama.cpp's format) as a Hugging Face folder the engine loads.

    inspect_gguf(path)               metadata and tensor types; ValueError for a quantization
                                     the gguf package cannot dequantize
    write_gguf_folder(path, out_dir) config.json, generation_config.json, tokenizer files, chat
                                     template, gguf_source.json naming the file: the weights stay
                                     in the GGUF (engine/loader/gguf_model.py loads them)
    convert_gguf(path, out_dir)      the same and model.safetensors, the weights dequantized: the
                                     default model's folder (engine/loader/model_files.py)

The architecture must be one transformers' GGUF loader reads and one the engine serves
(`engine.models.MODEL_CLASSES`); anything else is a ValueError naming it. Q4_0, Q4_1,
Q5_x, Q8_0, the K-quants, the IQ types, F16, BF16 and F32 all dequantize.

convert_gguf's weights are stored in fp32: the exact dequantized values, so the folder served in fp32
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


def inspect_gguf(gguf_path: Path, check_dequantize: bool = True) -> GgufInfo:
    """Read a GGUF's metadata and (with `check_dequantize`) check that every tensor type can be
    dequantized; a file loaded directly (engine/loader/gguf_model.py) checks its types at load,
    knowing which have kernels.

    Raises ValueError naming the problem: not readable by the `gguf` package (an unknown
    tensor type, a newer format, a truncated or corrupt file), or a quantization it cannot
    dequantize."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as error:
        raise ValueError(f"{gguf_path.name}: the gguf package (version {_gguf_version()}) cannot read it: {error}. "
                         "A truncated or corrupt file, or a tensor type or format version newer than it knows?"
                         ) from error
    architecture = _read_field(reader, "general.architecture")
    if not reader.tensors or architecture is None:
        raise ValueError(f"{gguf_path.name}: no tensors or no general.architecture, not a model GGUF")
    size = gguf_path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(f"{gguf_path.name}: truncated GGUF: tensor {tensor.name} ends at byte "
                             f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
    readable = set(GGUF_FLOAT_TYPES)
    for tensor in reader.tensors if check_dequantize else ():
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


def write_gguf_folder(gguf_path: Path, out_dir: Path) -> None:
    """The small files of a GGUF served from its own blocks (engine/loader/gguf_model.py): config,
    generation config, tokenizer, chat template, and gguf_source.json naming the file."""
    info = inspect_gguf(gguf_path, check_dequantize=False)
    config, tokenizer = _config_and_tokenizer(gguf_path, info)
    _write_model_files(gguf_path, out_dir, info, config, tokenizer, {"path": str(gguf_path.resolve())})


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF of an architecture the engine serves into an HF folder: weights
    (fp32 unless too large, see GgufInfo.weights_dtype), config, tokenizer, chat template."""
    info = inspect_gguf(gguf_path)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config, tokenizer = _config_and_tokenizer(gguf_path, info)
    dtype = getattr(torch, info.weights_dtype)
    needed = info.num_elements * dtype.itemsize
    if shutil.disk_usage(out_dir.parent).free < needed * 1.05:
        raise RuntimeError(f"{gguf_path.name}: converting needs {needed / 1e9:.1f} GB free in {out_dir.parent}")
    # The meta-device model only supplies parameter names for the GGUF -> HF mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    logger.info("dequantizing %s to %s", gguf_path.name, info.weights_dtype)
    try:
        with memoized_tensor_name_maps():
            parsed = load_gguf_checkpoint(
                str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype
            )
    except NotImplementedError as error:
        raise ValueError(f"{gguf_path.name}: transformers cannot load its tensors: {error}") from error
    tensors = {name: t.to(dtype).contiguous() for name, t in parsed["tensors"].items()}
    _check_tensors(tensors, skeleton, config)

    weights_path = out_dir / "model.safetensors"
    out_dir.mkdir(parents=True)
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors writes 0600; the cache is shared
    _write_model_files(gguf_path, out_dir, info, config, tokenizer, {})


def _config_and_tokenizer(gguf_path: Path, info: GgufInfo):
    """transformers' config (its architecture one the engine serves) and tokenizer of a GGUF."""
    from transformers import AutoConfig, AutoTokenizer

    folder, file_name = str(gguf_path.parent), gguf_path.name
    types = ", ".join(f"{count} {name}" for name, count in sorted(info.tensor_types.items()))
    logger.info("%s: %s, %.0fM parameters (%s tensors)", file_name, info.architecture, info.num_elements / 1e6, types)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{file_name}: transformers' GGUF loader cannot read architecture "
                         f"{info.architecture!r}: {error}") from error
    config.architectures = [_served_architecture(config, info, file_name)]
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{file_name}: transformers cannot build a tokenizer from its metadata: {error}") from error
    return config, tokenizer


def _write_model_files(gguf_path: Path, out_dir: Path, info: GgufInfo, config, tokenizer, source: dict) -> None:
    """config.json, generation_config.json, the tokenizer and chat template, gguf_source.json."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    _save_config(config, out_dir, info.weights_dtype)
    generation_config = GenerationConfig.from_model_config(config)
    stop_ids = list(dict.fromkeys([*_as_list(config.eos_token_id), *info.stop_token_ids]))
    if len(stop_ids) > 1:  # an end-of-turn token besides EOS: stop on both, as llama.cpp does
        generation_config.eos_token_id = stop_ids
    generation_config.save_pretrained(out_dir)

    if not tokenizer.chat_template and info.chat_template is not None:
        logger.info("restoring the chat template from GGUF metadata")
        tokenizer.chat_template = info.chat_template
    if not tokenizer.chat_template:  # a base model: completions serve; chat requests get a 400 saying why
        logger.warning("%s has no chat template: only completions are served", gguf_path.name)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    stat = gguf_path.stat()
    source = {"file": gguf_path.name, "size": stat.st_size, "architecture": info.architecture,
              "tensor_types": info.tensor_types, "weights_dtype": info.weights_dtype, **source}
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



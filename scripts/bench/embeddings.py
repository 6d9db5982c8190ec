"""Embedding throughput, in prompt tokens per second, against `/v1/embeddings` servers.

    python -m scripts.bench.embeddings --json results/bench_embeddings.json
    python -m scripts.bench.embeddings --peer-url http://127.0.0.1:8001 --peer-model FOLDER   # beside vLLM

Starts our server (`--runner pooling` unless --runner says otherwise; or measures --url),
then sends --num-texts English texts of 16-256 tokens (scripts/lib/workload.py's real
prompts, seeded) as --batch-size inputs per request with --concurrency requests in flight,
after a warm-up. Tokens are what each server's `usage.prompt_tokens` counts. A peer (e.g.
vLLM-CPU started with `vllm serve FOLDER --runner pooling`) gets the same requests in the
same run; the report gives the ratio and the lowest cosine between the two servers'
vectors of a text (the same model and pooling should give ~1).
"""

from __future__ import annotations

import argparse
import base64
import logging
import math
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from scripts.lib.bench_report import machine_info, run_and_report
from scripts.lib.local_server import start_server, stop_server
from scripts.lib.workload import make_workload

logger = logging.getLogger(__name__)


def make_texts(args) -> list[str]:
    from frontend.model_folder import resolve_model_folder
    from ipc.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_folder(args.model))
    workload = make_workload(args.num_texts, tuple(args.input_len), (1, 1), seed=args.seed, real_prompts=True,
                             tokenizer=tokenizer)
    return [request.prompt for request in workload]


def embed_batch(url: str, model: str | None, texts: list[str]) -> tuple[list[list[float]], int]:
    body = {"input": texts, "encoding_format": "base64", **({"model": model} if model else {})}
    response = requests.post(f"{url}/v1/embeddings", json=body, timeout=600)
    response.raise_for_status()
    answer = response.json()
    vectors = []
    for item in sorted(answer["data"], key=lambda d: d["index"]):
        raw = base64.b64decode(item["embedding"])
        vectors.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    return vectors, answer["usage"]["prompt_tokens"]


def measure(url: str, model: str | None, texts: list[str], args) -> dict:
    """Warm up, then every text once; (figures, the vectors in text order)."""
    embed_batch(url, model, texts[: args.batch_size])
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda batch: embed_batch(url, model, batch), batches))
    seconds = time.perf_counter() - start
    num_tokens = sum(n for _, n in results)
    vectors = [v for batch_vectors, _ in results for v in batch_vectors]
    return {"url": url, "seconds": round(seconds, 3), "num_tokens": num_tokens,
            "tokens_per_s": round(num_tokens / seconds, 1), "texts_per_s": round(len(texts) / seconds, 2),
            "embedding_size": len(vectors[0]), "vectors": vectors}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def run(args) -> dict:
    texts = make_texts(args)
    process = None
    url = args.url
    if url is None:
        logger.info("starting our server: --runner %s %s", args.runner, " ".join(args.server_arg))
        process, url, _ = start_server(args.model, ["--runner", args.runner, *args.server_arg], "bench-embeddings")
    try:
        ours = measure(url, None, texts, args)
    finally:
        if process is not None:
            stop_server(process)
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "num_texts": len(texts),
              "ours": {k: v for k, v in ours.items() if k != "vectors"}}
    if args.peer_url:
        peer = measure(args.peer_url, args.peer_model, texts, args)
        report["peer"] = {k: v for k, v in peer.items() if k != "vectors"}
        report["ours_vs_peer"] = round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
        if ours["embedding_size"] == peer["embedding_size"]:
            report["min_cosine_ours_vs_peer"] = round(min(map(cosine, ours["vectors"], peer["vectors"])), 6)
    report["machine"] = machine_info()
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="our server's model, and the texts' tokenizer")
    p.add_argument("--url", default=None, help="measure this running server instead of starting ours")
    p.add_argument("--runner", default="pooling", choices=("pooling", "generate"), help="our server's --runner")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for our server (repeat: --server-arg=--dtype --server-arg=float32)")
    p.add_argument("--peer-url", default=None, help="another /v1/embeddings server, e.g. vllm serve ... --runner pooling")
    p.add_argument("--peer-model", default=None, help="the model name the peer serves (its `model` field)")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"), help="tokens per text")
    p.add_argument("--batch-size", type=int, default=16, help="inputs per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.num_texts < 1 or args.batch_size < 1 or args.concurrency < 1:
        p.error("--num-texts, --batch-size and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    return run_and_report(parse_args, run, argv, logger)[1]


if __name__ == "__main__":
    main()

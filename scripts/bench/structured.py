"""Time per output token of chat requests constrained by a JSON schema against the same requests unconstrained.

    python -m scripts.bench.structured --json results/bench_structured.json        # starts its own server
    python -m scripts.bench.structured --url http://127.0.0.1:8000 --num-requests 4 --rounds 1   # a quick check

Each round sends --num-requests streamed /v1/chat/completions requests at once (the same
prompts every round, each asking for a person's profile as JSON), either all with
`response_format: {"type": "json_schema", ...}` (constrained) or all without it
(unconstrained), greedy unless --temperature, at a fixed max_tokens. A grammar cannot
ignore EOS, so answers end at different lengths and totals do not compare; TPOT does:
per request (latency - TTFT) / (output tokens - 1) over the streamed chunks (bench_metrics'
definitions; the role-only opening chunk carries no token and is skipped). Rounds
alternate (C U, U C, C U, ...) so drift in a shared machine's load hits both arms. The
report gives each arm's TPOT p50 per round, the median over rounds, and the ratio
constrained / unconstrained (of the medians, and the median of the per-round pairs), plus
how many constrained answers ended with finish_reason "stop" and parse as JSON. Each arm's
median output length is reported too: shorter answers leave the batch sooner, and a
smaller batch decodes faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter

import aiohttp

from scripts.bench.serving import TIMEOUT
from scripts.lib.sse_client import served_model
from scripts.lib.bench_metrics import RequestTrace, summarize_traces
from scripts.lib.bench_report import write_report
from scripts.lib.local_server import start_server, stop_server
from scripts.lib.sse_client import ERROR_BODY_CHARS, StreamStatusError, stream_chunks


TARGET_TPOT_RATIO = 1.1  # the issue's target: constrained TPOT within 10% of unconstrained
ARMS = ("constrained", "unconstrained")
ROLES = ("engineer", "designer", "manager", "scientist", "teacher", "doctor")

PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "city": {"type": "string", "maxLength": 40},
        "role": {"type": "string", "enum": list(ROLES)},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
        "is_remote": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "role", "skills", "is_remote"],
    "additionalProperties": False,
}

CITIES = ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney")


def make_prompts(num_requests: int) -> list[str]:
    """Distinct requests for a profile, cycling through roles and cities."""
    prompts = []
    for i in range(num_requests):
        role, city = ROLES[i % len(ROLES)], CITIES[(i // len(ROLES) + i) % len(CITIES)]
        prompts.append(
            f"Invent a {role} who lives in {city} (person number {i + 1}). Answer with a JSON object only, "
            f"with the fields name (string), age (integer), city (string), role (one of {', '.join(ROLES)}), "
            "skills (a list of up to 4 short strings) and is_remote (true or false).")
    return prompts


def response_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE_SCHEMA}}


async def send_chat(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                    temperature: float, is_constrained: bool) -> tuple[RequestTrace, str | None]:
    """One streamed chat completion; its trace (text included) and finish reason."""
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if is_constrained:
        payload["response_format"] = response_format()
    trace = RequestTrace(send_time=time.perf_counter())
    finish_reason = None
    usage = None
    try:
        async for now, chunk in stream_chunks(session, url, payload):
            if "error" in chunk:
                trace.is_success = False
                trace.error = str(chunk["error"])[:ERROR_BODY_CHARS]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if content or choice.get("finish_reason"):  # the opening role-only chunk holds no token
                    trace.chunk_times.append(now)
                    trace.text += content
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                usage = chunk["usage"]
    except StreamStatusError as e:
        trace.is_success = False
        trace.error = str(e)
        return trace, None
    except Exception as e:  # noqa: BLE001 - a failure counts against this request, not the run
        trace.is_success = False
        trace.error = f"{type(e).__name__}: {e}"
        return trace, None
    if usage is not None:
        trace.num_output_tokens = usage.get("completion_tokens", 0)
        trace.num_prompt_tokens = usage.get("prompt_tokens", 0)
    else:
        trace.is_success = False
        trace.error = "no usage chunk"
    if not trace.chunk_times:
        trace.is_success = False
        trace.error = trace.error or "the stream carried no tokens"
    return trace, finish_reason


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def run_round(base_url: str, model: str | None, prompts: list[str], max_tokens: int, temperature: float,
                    is_constrained: bool) -> dict:
    """Every prompt at once; the round's summary, finish reasons and JSON validity."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await served_model(session, base_url)
        start = time.perf_counter()
        results = await asyncio.gather(*(send_chat(session, url, model, p, max_tokens, temperature, is_constrained)
                                         for p in prompts))
        duration = time.perf_counter() - start
    traces = [t for t, _ in results]
    summary = summarize_traces(traces, duration)
    ok = [(t, reason) for t, reason in results if t.is_success]
    return {
        "summary": summary,
        "tpot_p50_s": summary["tpot_s"]["median"],
        "num_output_tokens_median": statistics.median(t.num_output_tokens for t, _ in ok) if ok else None,
        "finish_reasons": dict(Counter(str(reason) for _, reason in ok)),
        "num_stop_and_json": sum(reason == "stop" and parses_as_json(t.text) for t, reason in ok),
        "num_json": sum(parses_as_json(t.text) for t, _ in ok),
        "errors": [t.error for t in traces if not t.is_success][:5],
        "sample_texts": [t.text for t, _ in ok[:2]],
    }


def compare(rounds: dict[str, list[dict]], num_requests: int) -> dict:
    def median_or_none(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    arms = {}
    for arm in ARMS:
        by_round = [r["tpot_p50_s"] for r in rounds[arm]]
        arms[arm] = {
            "tpot_p50_ms_by_round": [None if v is None else v * 1e3 for v in by_round],
            "tpot_p50_ms_median": None if median_or_none(by_round) is None else median_or_none(by_round) * 1e3,
            "ttft_p50_ms_median": median_or_none(
                [None if r["summary"]["ttft_s"]["median"] is None else r["summary"]["ttft_s"]["median"] * 1e3
                 for r in rounds[arm]]),
            "num_output_tokens_median": median_or_none([r["num_output_tokens_median"] for r in rounds[arm]]),
            "finish_reasons": dict(sum((Counter(r["finish_reasons"]) for r in rounds[arm]), Counter())),
            "num_requests": num_requests * len(rounds[arm]),
            "num_failed": sum(r["summary"]["num_failed"] for r in rounds[arm]),
            "num_stop_and_json": sum(r["num_stop_and_json"] for r in rounds[arm]),
            "num_json": sum(r["num_json"] for r in rounds[arm]),
        }
    c, u = arms["constrained"], arms["unconstrained"]
    ratio = c["tpot_p50_ms_median"] / u["tpot_p50_ms_median"] \
        if c["tpot_p50_ms_median"] and u["tpot_p50_ms_median"] else None
    paired = [a / b for a, b in zip(c["tpot_p50_ms_by_round"], u["tpot_p50_ms_by_round"]) if a and b]
    return {
        "arms": arms,
        "tpot_ratio": ratio,
        "tpot_ratio_paired_median": statistics.median(paired) if paired else None,
        "target_tpot_ratio": TARGET_TPOT_RATIO,
        "meets_target": ratio is not None and ratio <= TARGET_TPOT_RATIO,
    }


def print_table(result: dict) -> None:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("arm", "TPOT p50 ms", "by round", "TTFT p50 ms", "out tok p50", "stop+JSON", "finish reasons")
    rows = [header]
    for arm, a in result["arms"].items():
        rows.append((arm, fmt(a["tpot_p50_ms_median"], ".2f"),
                     " ".join(fmt(v, ".1f") for v in a["tpot_p50_ms_by_round"]),
                     fmt(a["ttft_p50_ms_median"], ".0f"), fmt(a["num_output_tokens_median"], ".0f"),
                     f"{a['num_stop_and_json']}/{a['num_requests']}",
                     ",".join(f"{k}:{v}" for k, v in sorted(a["finish_reasons"].items()))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    print(f"TPOT constrained / unconstrained: {fmt(result['tpot_ratio'], '.3f')} (paired by round: "
          f"{fmt(result['tpot_ratio_paired_median'], '.3f')}); target <= {result['target_tpot_ratio']}: "
          f"{'met' if result['meets_target'] else 'MISSED'}")


def run(args: argparse.Namespace, base_url: str) -> dict:
    prompts = make_prompts(args.num_requests)
    # Compiles the schema (xgrammar caches it), builds the tokenizer info and warms both paths.
    for is_constrained in (True, False):
        warm = asyncio.run(run_round(base_url, args.model, prompts[:args.num_warmup], 8, args.temperature,
                                     is_constrained))
        if warm["errors"]:
            raise SystemExit(f"the warm-up failed: {warm['errors'][0]}")
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for index in range(args.rounds):
        order = ARMS if index % 2 == 0 else ARMS[::-1]
        for arm in order:
            result = asyncio.run(run_round(base_url, args.model, prompts, args.max_tokens, args.temperature,
                                           arm == "constrained"))
            rounds[arm].append(result)
            tpot = result["tpot_p50_s"]
            print(f"round {index + 1}/{args.rounds} {arm}: TPOT p50 "
                  f"{'-' if tpot is None else f'{tpot * 1e3:.2f}'} ms, "
                  f"{result['num_output_tokens_median']} tokens p50, finish {result['finish_reasons']}", flush=True)
    return {"rounds": rounds, **compare(rounds, args.num_requests)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server; default: start one (frontend.api_server)")
    p.add_argument("--model", default=None, help="the served model name; default: the first in /v1/models")
    p.add_argument("--server-model", default="smollm2", help="the model our server loads")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for our server (repeat: --server-arg=--max-num-seqs --server-arg=64)")
    p.add_argument("--num-requests", type=int, default=32, help="concurrent requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per arm, alternating")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-warmup", type=int, default=4, help="short requests per arm before the rounds")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    for name in ("num_requests", "rounds", "num_warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2: TPOT needs two tokens")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    process = log_path = None
    base_url = args.url
    if base_url is None:
        print("starting our server", flush=True)
        process, base_url, log_path = start_server(args.server_model, args.server_arg, log_name="bench-structured")
    try:
        result = run(args, base_url)
    finally:
        if process is not None:
            stop_server(process)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "url": base_url,
        "server_log": None if log_path is None else str(log_path),
        "schema": PROFILE_SCHEMA,
        **result,
    }
    summary = {k: v for k, v in report.items() if k != "rounds"}
    print(json.dumps(summary, indent=1))
    print_table(result)
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()

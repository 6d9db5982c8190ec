"""The hostile script's named cases, one function per known defect; each returns a dict with "passed".

Raw-connection cases (slowloris, headers, 413) live in scripts/hostile/conn.py, the field fuzzer in
scripts/hostile/fuzz.py. A case may leave the core dead; scripts/hostile/run.py waits for /health between cases.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from scripts.hostile.client import LocalClient, Target, error_problem, finals

HEALTH_SLACK_S = 10.0  # beyond --engine-timeout, for the frontend to notice and say so
RESTART_WAIT_S = 120.0  # a fresh core loads the model again
# The frontend's grammar check gives up after 5 s; a request queued behind it then waits for a fresh
# checker (imports torch and xgrammar: seconds on a busy machine) and its own compile in a core.
GRAMMAR_ANSWER_S = 20.0
GRAMMAR_DRAIN_S = 600.0  # how long a slow compile may keep the core's compile thread busy after its case


def oov_stop_token(target: Target) -> dict:
    """Out-of-vocabulary stop token ids (banned while min_tokens is not reached) must get a 400, core untouched."""
    pids = target.core_pids()
    seen = []
    for token_id in (target.vocab_size, 100_000, 2**31 - 1):
        body = {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "temperature": 0, "stop_token_ids": [token_id]}
        status, text, _ = target.post("/v1/completions", body)
        is_alive = target.health()[0] == 200 and target.core_pids() == pids
        seen.append({"stop_token_id": token_id, "status": status, "body": text[:200], "core_alive": is_alive})
        if not is_alive:
            break  # each death costs a restart; one is proof enough
    passed = all(s["status"] == 400 and not error_problem(400, s["body"]) and s["core_alive"] for s in seen)
    return {"passed": passed, "answers": seen}


def tiny_temperature(target: Target, greedy_text: str) -> dict:
    """temperature 1e-40 is greedy in all but name: the same text as temperature 0."""
    got = target.greedy(temperature=1e-40)
    return {"passed": got["status"] == 200 and got["text"] == greedy_text, "greedy": greedy_text,
            "temperature_1e-40": got["text"]}


def local_abort_race(target: Target, num_pairs: int) -> dict:
    """GenerateRequest then AbortRequests for the same id, back to back: every id gets exactly one final output."""
    ids = [f"race-{i}" for i in range(num_pairs)]
    with LocalClient(target.client_socket) as local:
        for request_id in ids:
            local.generate(request_id, max_tokens=32, min_tokens=0, ignore_eos=True)
            local.abort([request_id])
        outputs = local.collect(ids, timeout_s=30, linger_s=1.0)
    ends = {rid: finals(outputs[rid]) for rid in ids}
    no_final = [rid for rid, e in ends.items() if not e]
    several = {rid: e for rid, e in ends.items() if len(e) > 1}
    reasons: dict[str, int] = {}
    for e in ends.values():
        for reason, _ in e:
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"passed": not no_final and not several, "num_pairs": num_pairs, "final_reasons": reasons,
            "ids_without_final": no_final, "ids_with_several_finals": several}


def duplicate_local_id(target: Target) -> dict:
    """A second GenerateRequest reusing a running id: still exactly one final output for that id."""
    with LocalClient(target.client_socket) as local:
        local.generate("dup", max_tokens=8, min_tokens=0, ignore_eos=True)
        local.generate("dup", max_tokens=8, min_tokens=0, ignore_eos=True)
        # Not "until the first final": today that is the duplicate's, while the original still streams.
        outputs = local.drain_until_quiet(quiet_s=5.0, timeout_s=60).get("dup", [])
        local.abort(["dup"])
    ends = finals(outputs)
    return {"passed": len(ends) == 1, "finals_in_order": ends, "num_tokens": sum(len(o[2]) for o in outputs)}


def big_prompt_does_not_freeze(target: Target, num_prompts: int, max_latency_s: float = 0.3) -> dict:
    """While a client posts ~1 MiB prompts (tokenized, then too long), /health must keep answering quickly."""
    rng = random.Random(0)
    words, num_chars = [], 0
    while num_chars < 1_000_000:  # under the default 1 MiB body limit; varied words, so no tokenizer cache helps
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
        num_chars += len(words[-1]) + 1
    body = {"prompt": " ".join(words), "max_tokens": 1}
    statuses: list[int] = []

    def post_big_prompts() -> None:
        for _ in range(num_prompts):
            statuses.append(target.post("/v1/completions", body, timeout=120)[0])

    poster = threading.Thread(target=post_big_prompts, daemon=True)
    latencies = []
    poster.start()
    while poster.is_alive():
        latencies.append(target.health(timeout=30)[1])
        time.sleep(0.05)
    poster.join()
    worst = max(latencies, default=0.0)
    return {"passed": worst < max_latency_s and all(400 <= s < 500 for s in statuses),
            "prompt_chars": len(body["prompt"]), "big_prompt_statuses": statuses,
            "health_max_latency_s": round(worst, 3), "num_health_probes": len(latencies)}


def socket_takeover(target: Target, second_server: list[str], log_path: Path) -> dict:
    """A second server on the same --client-socket must refuse to start; the first keeps serving on it."""
    with open(log_path, "wb") as log:
        second = subprocess.Popen(second_server, stdout=log, stderr=subprocess.STDOUT)
    second_url = f"http://127.0.0.1:{second_server[second_server.index('--port') + 1]}"
    deadline = time.monotonic() + RESTART_WAIT_S
    try:
        # It should refuse before loading anything; serving /health means it took the socket over.
        while second.poll() is None and time.monotonic() < deadline and not Target(second_url).health(1)[0]:
            time.sleep(0.5)
        exit_code = second.poll()  # None: it took the socket over and kept running
    finally:
        if second.poll() is None:
            second.terminate()
            try:
                second.wait(60)
            except subprocess.TimeoutExpired:
                second.kill()
                second.wait()
    first_health = target.health()[0]
    with LocalClient(target.client_socket) as local:
        local.generate("after-takeover", max_tokens=2)
        ends = finals(local.collect(["after-takeover"], timeout_s=20)["after-takeover"])
    passed = exit_code not in (None, 0) and first_health == 200 and [e[0] for e in ends] == ["length"]
    return {"passed": passed, "second_server_exit_code": exit_code, "second_server_log": str(log_path),
            "first_server_health": first_health, "first_server_local_socket_finals": ends}


def sigstop_core(target: Target, engine_timeout_s: float) -> dict:
    """SIGSTOP the core: /health turns 503 and the in-flight request fails; a new core then serves again."""
    old_pid = target.core_pids()[0]
    window_s = engine_timeout_s + HEALTH_SLACK_S
    in_flight: dict = {}

    def long_request() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        status, text, _ = target.post("/v1/completions", body, timeout=window_s + 30)
        in_flight.update(status=status, body=text[:200], ended_after_stop_s=round(time.monotonic() - stopped_at, 1))

    stopped_at = time.monotonic()
    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    wait_until = time.monotonic() + 10
    while target.metrics()["num_requests_running"] < 1 and time.monotonic() < wait_until:
        time.sleep(0.05)
    os.kill(old_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    health_503_s = None
    try:
        while time.monotonic() - stopped_at < window_s:
            if target.health(timeout=2)[0] == 503:
                health_503_s = round(time.monotonic() - stopped_at, 1)
                break
            time.sleep(0.2)
        worker.join(max(0.0, window_s - (time.monotonic() - stopped_at)))
        in_flight_failed_in_time = not worker.is_alive() and in_flight.get("status") != 200
        new_pid = None
        if health_503_s is not None:  # the server noticed; give it time to replace the core
            deadline = time.monotonic() + RESTART_WAIT_S
            while time.monotonic() < deadline and (not (pids := target.core_pids()) or old_pid in pids):
                time.sleep(0.25)
            new_pid = next((p for p in target.core_pids() if p != old_pid), None)
    finally:
        try:
            os.kill(old_pid, signal.SIGCONT)  # a core the server did not replace must not stay frozen
        except ProcessLookupError:
            pass
    back_s = target.wait_healthy(RESTART_WAIT_S)
    worker.join(30)
    after = target.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})[0]
    return {
        "passed": bool(health_503_s is not None and in_flight_failed_in_time and new_pid and after == 200),
        "engine_timeout_s": engine_timeout_s,
        "health_503_after_s": health_503_s,  # None: /health stayed 200 for the whole window
        "in_flight": in_flight,
        "in_flight_failed_within_window": in_flight_failed_in_time,
        "old_core_pid": old_pid,
        "new_core_pid": new_pid,
        "healthy_again_after_s": None if back_s is None else round(back_s, 1),
        "request_after_status": after,
    }


def slow_grammar_compile(target: Target, num_groups: int) -> dict:
    """A regex that the frontend's check parses in milliseconds but the core compiles for a minute: "(a|b)"
    repeated (20,000 times: 100 KB, under the 256 KiB cap). With SmolLM2's vocabulary the compile takes about
    12 s at 10,000 and 60 s at 20,000 on two idle cores, 64 s and 7.5 minutes on busy ones. Its client
    should get a 4xx (or its answer) soon, and meanwhile another client's small structured request, a plain
    request and /health must be served. Afterwards the case waits until a small structured request is
    served again, so later cases are not hit. Run it with num_groups=20000 (--quick) or 30000."""
    nonce = f"{random.randrange(10**9):09d}"  # not in any grammar cache
    slow_body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                 "structured_outputs": {"regex": "(a|b)" * num_groups + nonce}}
    slow: dict = {}

    def post_slow() -> None:
        status, text, seconds = target.post("/v1/completions", slow_body, timeout=GRAMMAR_DRAIN_S)
        slow.update(status=status, body=text[:200], seconds=round(seconds, 1))

    def small_structured(tag: str) -> tuple[int, str, float]:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                "structured_outputs": {"regex": f"[0-9]{{2}}(x{nonce}{tag})?"}}
        return target.post("/v1/completions", body, timeout=GRAMMAR_DRAIN_S)

    worker = threading.Thread(target=post_slow, daemon=True)
    worker.start()
    time.sleep(1.0)  # past the frontend's check: the core is compiling it
    status, text, seconds = small_structured("other")
    other = {"status": status, "body": text[:200], "seconds": round(seconds, 1)}
    status, _, seconds = target.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    plain = {"status": status, "seconds": round(seconds, 1)}
    health_latency = max(target.health()[1] for _ in range(5))
    worker.join(GRAMMAR_DRAIN_S)
    start, drained_s = time.monotonic(), None
    for i in range(100):  # each try waits behind whatever the compile thread still does
        if small_structured(f"drain{i}")[0] == 200:
            drained_s = round(time.monotonic() - start, 1)
            break
        if time.monotonic() - start > GRAMMAR_DRAIN_S:
            break
    slow_ok = (400 <= slow.get("status", 0) < 500 or slow.get("status") == 200) \
        and slow.get("seconds", GRAMMAR_DRAIN_S) < GRAMMAR_ANSWER_S
    other_ok = other["status"] == 200 and other["seconds"] < GRAMMAR_ANSWER_S
    return {"passed": bool(slow_ok and other_ok and plain["status"] == 200 and health_latency < 1.0),
            "regex_bytes": len(slow_body["structured_outputs"]["regex"]), "slow_request": slow,
            "other_structured_request": other, "plain_request": plain,
            "health_max_latency_s": round(health_latency, 3),
            "structured_served_again_after_s": drained_s}  # None: still not, GRAMMAR_DRAIN_S later


def unsatisfiable_grammar(target: Target) -> dict:
    """Constraints no token can meet: a regex that matches nothing, a grammar that has ended while
    min_tokens bans the end, a regex whose characters allowed_token_ids leaves out. Each should get a
    4xx naming the structured output, or a 200 with one of OpenAI's finish reasons (never "error"
    without a word of why)."""
    bodies = {
        "empty_class_regex": {"structured_outputs": {"regex": "[^\\s\\S]"}},
        "choice_ended_before_min_tokens": {"structured_outputs": {"choice": ["a"]}, "min_tokens": 5,
                                           "max_tokens": 8},
        "regex_outside_allowed_token_ids": {"structured_outputs": {"regex": "[0-9]+"},
                                            "allowed_token_ids": list(range(60, 90))},  # letters, no digits
    }
    answers = {}
    for name, fields in bodies.items():
        status, text, _ = target.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                           **fields})
        finish_reasons = None
        if status == 200:
            finish_reasons = [c.get("finish_reason") for c in json.loads(text)["choices"]]
        is_sane = (400 <= status < 500 and error_problem(status, text) is None) or (
            status == 200 and set(finish_reasons) <= {"stop", "length"})
        answers[name] = {"status": status, "finish_reasons": finish_reasons, "body": text[:200], "sane": is_sane}
    return {"passed": all(a["sane"] for a in answers.values()), "answers": answers}


def bad_predictions(target: Target) -> dict:
    """OpenAI's `prediction` that cannot be used: longer than the context, not text, with n > 1.
    Each must be a 400 naming `prediction`, on both routes, and never reach (or kill) a core."""
    pids = target.core_pids()
    too_long = " hello" * (target.max_model_len + 64)  # one token per word in any BPE vocabulary: past the context
    predictions = {
        "over_the_context": ({"type": "content", "content": too_long}, 1),
        "not_text_parts": ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, 1),
        "not_text_number": ({"type": "content", "content": 5}, 1),
        "not_content_type": ({"type": "text", "content": "hello"}, 1),
        "with_n_2": ({"type": "content", "content": "hello"}, 2),
    }
    answers = {}
    for name, (prediction, n) in predictions.items():
        for route, fields in (("/v1/completions", {"prompt": "Hello"}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
            body = {**fields, "max_tokens": 4, "temperature": 0, "n": n, "prediction": prediction}
            status, text, _ = target.post(route, body)
            problem = error_problem(status, text) if status == 400 else f"status {status}: {text[:200]!r}"
            if problem is None and "prediction" not in json.loads(text)["error"]["message"]:
                problem = f"the message does not name prediction: {text[:200]!r}"
            answers[f"{name} {route}"] = {"status": status, "body": text[:200], "problem": problem}
    is_alive = target.health()[0] == 200 and target.core_pids() == pids
    return {"passed": is_alive and all(a["problem"] is None for a in answers.values()), "core_alive": is_alive,
            "answers": answers}

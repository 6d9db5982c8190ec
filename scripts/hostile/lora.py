"""The hostile case for LoRA adapters (frontend/serving_lora.py, docs/lora.md): bad adapters and names.

Against a server started with --enable-lora --allow-runtime-lora-updating (run.py starts its own so),
it writes adapters into a temporary folder and sends each bad input once: an unknown adapter as
`model`, a rank above --max-lora-rank, a target module the model lacks, another model's shapes,
missing or corrupt files, a path that is not a folder, a duplicate name, a missing field; then a
flood of 1,000 loads (names only: each core loads an adapter when a request first names it and
keeps at most --max-cpu-loras), a request on a few of them, and 1,000 unloads. Each bad input must
get a 4xx whose message names the field, every flood answer a 200 or a clean 4xx, and the core
must be the same process at the end. A server without --enable-lora answers each load with a 400
naming the flag, which passes too.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from scripts.hostile.client import Target, error_problem
from scripts.lib.lora_adapters import write_adapter

NUM_FLOOD = 1000
COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def write_cases(tmp: Path, model_path: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """The good adapter's folder, and each bad case: name -> (its lora_path, a word its error must hold)."""
    good = write_adapter(tmp / "good", model_path, rank=8, seed=0)
    cases = {"rank_above_max": (write_adapter(tmp / "r64", model_path, rank=64, seed=1), "max_lora_rank"),
             "missing_target_module": (write_adapter(tmp / "qkv", model_path, rank=8, seed=2,
                                                     target_modules=["qkv_proj"]), "target_modules"),
             "dora": (write_adapter(tmp / "dora", model_path, rank=8, seed=3, use_dora=True), "use_dora"),
             "not_a_folder": (str(Path(good) / "adapter_config.json"), "not a folder"),
             "no_such_path": (str(tmp / "nowhere"), "not a folder")}
    other = tmp / "other-model"
    other.mkdir()
    config = json.loads((Path(model_path) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    cases["another_models_shapes"] = (write_adapter(tmp / "other", str(other), rank=8, seed=4), "this model needs")
    for name, damage in (("missing_config", "rm_config"), ("corrupt_config", "config"),
                         ("missing_weights", "rm_weights"), ("corrupt_weights", "weights")):
        folder = tmp / name
        shutil.copytree(good, folder)
        if damage == "rm_config":
            (folder / "adapter_config.json").unlink()
        elif damage == "config":
            (folder / "adapter_config.json").write_text("{r: 8")
        elif damage == "rm_weights":
            (folder / "adapter_model.safetensors").unlink()
        else:
            (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
        cases[name] = (str(folder), "adapter_")
    return good, cases


def lora_bad_input(target: Target, tmp: Path, model_path: str, num_flood: int = NUM_FLOOD) -> dict:
    pids = target.core_pids()
    good, cases = write_cases(tmp / "lora", model_path)
    answers: dict[str, dict] = {}

    def expect_4xx(name: str, status: int, text: str, word: str) -> None:
        problem = error_problem(status, text) if 400 <= status < 500 else f"status {status}: {text[:200]!r}"
        if problem is None and word not in text:
            problem = f"the error does not name {word!r}: {text[:200]!r}"
        answers[name] = {"status": status, "problem": problem}

    status, text, _ = target.post("/v1/completions", {**COMPLETION, "model": "no-such-adapter"})
    expect_4xx("unknown_adapter", status, text, "The model `no-such-adapter` does not exist")
    status, text, _ = target.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": good})
    is_enabled = status == 200
    if not is_enabled:  # a server without --enable-lora: every load is a 400 naming the flag
        expect_4xx("load_when_off", status, text, "--enable-lora")
    else:
        for name, (path, word) in cases.items():
            status, text, _ = target.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            expect_4xx(name, status, text, word)
        status, text, _ = target.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": good})
        expect_4xx("duplicate_name", status, text, "lora_name")
        status, text, _ = target.post("/v1/load_lora_adapter", {"lora_name": "x"})
        expect_4xx("missing_lora_path", status, text, "lora_path")
        status, text, _ = target.post("/v1/completions", {**COMPLETION, "model": "good"})
        answers["good_adapter_answers"] = {"status": status, "problem": None if status == 200 else text[:200]}
        answers["flood"] = flood(target, good, num_flood)
        target.post("/v1/unload_lora_adapter", {"lora_name": "good"})
    problems = {name: a for name, a in answers.items() if a.get("problem")}
    is_alive = target.health()[0] == 200 and target.core_pids() == pids
    return {"passed": not problems and is_alive, "lora_enabled": is_enabled, "num_sent": len(answers),
            "core_alive_same_pid": is_alive, "problems": problems}


def flood(target: Target, good: str, num_flood: int = NUM_FLOOD) -> dict:
    """`num_flood` loads of one folder under new names, a request on three of them, then as many unloads."""
    start = time.monotonic()
    statuses: dict[int, int] = {}
    problem = None
    for i in range(num_flood):
        status, text, _ = target.post("/v1/load_lora_adapter", {"lora_name": f"flood-{i}", "lora_path": good})
        statuses[status] = statuses.get(status, 0) + 1
        if status != 200 and (status >= 500 or error_problem(status, text)):
            problem = problem or f"load {i}: status {status}: {text[:200]!r}"
    for i in (0, num_flood // 2, num_flood - 1):
        status, text, _ = target.post("/v1/completions", {**COMPLETION, "model": f"flood-{i}"}, timeout=120)
        if status not in (200, 404):
            problem = problem or f"a request on flood-{i}: status {status}: {text[:200]!r}"
    for i in range(num_flood):
        target.post("/v1/unload_lora_adapter", {"lora_name": f"flood-{i}"})
    return {"statuses": statuses, "seconds": round(time.monotonic() - start, 1), "problem": problem}

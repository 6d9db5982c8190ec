"""Where static-padded batching loses to continuous batching, in tokens computed and seconds.

Three measured runs of one workload, in one session, at the same batch size:

    continuous ──(head-of-line waiting)──► static ──(padding compute)──► static-padded

- head-of-line: static − continuous. Both compute the same tokens (flat batches, no
  padding); static takes more, smaller steps because a batch's finished slots stay empty
  until its longest member ends. Its tokens: the extra positions computed (only
  preemption's recomputation) and the row-steps left empty, which static-padded fills
  with pad-token decodes of its finished rows.
- padding: static-padded − static, the same batches with their padding computed. Split
  in two: the left padding's share of static-padded's prefill steps (those steps are
  compute-bound, so a step's time goes by its tokens), and the finished rows' pad-token
  decodes, the rest.
- memory: static-padded on a pool too small for batches of N (its reservations for
  prompt + max_tokens admit fewer rows) − static-padded on a pool that holds them.
  Zero, with the batch size shown, when no smaller pool was measured.

Each term's tokens are positions run through the model (`num_computed_positions`).
"""

from __future__ import annotations


def left_padding_seconds(step_stats: dict) -> float:
    """The left padding's share of each prefill step's time, by tokens."""
    total = 0.0
    for start, end, num_tokens, num_padding in zip(step_stats["start_s"], step_stats["end_s"],
                                                   step_stats["num_tokens"], step_stats["num_padding_tokens"]):
        if num_padding:
            total += (end - start) * num_padding / (num_tokens + num_padding)
    return total


def term(seconds: float, num_tokens: int, **extra) -> dict:
    return {"seconds": seconds, "tokens_computed": num_tokens, **extra}


def attribute(continuous: dict, static: dict, padded: dict, padded_bounded: dict | None = None) -> dict:
    """Each argument a bench_offline result (summary fields and `step_stats` columns).
    `padded_bounded`: static-padded again on a smaller pool; the memory term compares it to `padded`."""
    c, s, p = continuous, static, padded
    left_s = left_padding_seconds(p["step_stats"])
    padding_s = p["elapsed_s"] - s["elapsed_s"]
    result = {
        "total": term(p["elapsed_s"] - c["elapsed_s"], p["num_computed_positions"] - c["num_computed_positions"]),
        "head_of_line": term(s["elapsed_s"] - c["elapsed_s"], s["num_computed_positions"] - c["num_computed_positions"],
                             num_extra_steps=s["num_steps"] - c["num_steps"],
                             num_idle_row_steps=p["num_finished_row_tokens"]),
        "padding": term(padding_s, p["num_computed_positions"] - s["num_computed_positions"],
                        left_padding=term(left_s, p["num_padding_tokens"]),
                        finished_rows=term(padding_s - left_s, p["num_finished_row_tokens"])),
        "memory": term(0.0, 0, batch_rows=p["max_batch_rows"]),
    }
    if padded_bounded is not None:
        b = padded_bounded
        result["memory"] = term(b["elapsed_s"] - p["elapsed_s"],
                                b["num_computed_positions"] - p["num_computed_positions"],
                                batch_rows=b["max_batch_rows"], batch_rows_unbounded=p["max_batch_rows"])
    return result


def format_attribution(name: str, a: dict) -> list[str]:
    """Markdown table rows: | workload | term | seconds | tokens computed | note |"""
    def row(label, t, note=""):
        return f"| {name} | {label} | {t['seconds']:+.2f} | {t['tokens_computed']:+,} | {note} |"

    hol, pad, mem = a["head_of_line"], a["padding"], a["memory"]
    memory_note = (f"batches of {mem['batch_rows']} instead of {mem['batch_rows_unbounded']}"
                   if "batch_rows_unbounded" in mem else f"the reservation admits the full batch ({mem['batch_rows']})")
    return [
        row("head-of-line waiting (static − continuous)", hol,
            f"{hol['num_extra_steps']:+,} steps; {hol['num_idle_row_steps']:,} row-steps left empty"),
        row("padding (static-padded − static)", pad),
        row("… left padding (share of prefill steps)", pad["left_padding"]),
        row("… finished rows' pad decodes (the rest)", pad["finished_rows"]),
        row("memory reservation (smaller batches)", mem, memory_note),
        row("**total (static-padded − continuous)**", a["total"]),
    ]

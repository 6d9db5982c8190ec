"""scripts/bench/probes/gguf_builds_ab: the baseline's kernel sources come out of git whole, beside the checkout's."""

from __future__ import annotations

import subprocess

from engine.cpu.extension import CSRC
from engine.cpu.gguf_extension import HEADERS, SOURCES
from scripts.bench.probes.gguf_builds_ab import SHAPES, parse_args, sources_at


def test_a_commit_gives_every_source_and_header_the_build_needs(tmp_path):
    csrc = sources_at("HEAD", tmp_path)
    root = CSRC.parents[2]
    for path in (*SOURCES, *HEADERS):
        old = csrc / path.relative_to(CSRC)
        committed = subprocess.run(["git", "show", f"HEAD:{path.relative_to(root)}"], cwd=root,
                                   capture_output=True, check=True).stdout
        assert old.read_bytes() == committed, old


def test_the_default_shapes_are_the_1b_prefills():
    args = parse_args(["--rev", "HEAD"])
    assert args.shapes.split(",") == list(SHAPES) and args.tokens == 512
    assert SHAPES["down_q6_k"] == ("Q6_K", 2048, 8192)

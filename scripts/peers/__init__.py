"""tokenloom beside vLLM: the vLLM-side runners and the summary table (driven by scripts/bench_peers.sh)."""

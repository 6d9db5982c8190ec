"""Benchmarks, peers, hostile clients, soaks, the simulator's command line and tools that look at the
code (tools/), each a module run from the repository root with `python -m scripts.<package>.<module>`;
shared code is in scripts/lib/."""

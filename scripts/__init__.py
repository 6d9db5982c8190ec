"""Benchmarks, peers, hostile clients, soaks and the simulator's command line, each a module run
from the repository root with `python -m scripts.<package>.<module>`; shared code is in scripts/lib/."""

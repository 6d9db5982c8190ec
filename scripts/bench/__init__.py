"""Benchmarks of tokenloom that users run: offline, serving, single user, static, structured, speculative, quant, TP."""

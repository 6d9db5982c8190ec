"""Benchmarks of tokenloom alone: offline, serving, structured outputs, kernels, IPC, TP, bounds."""

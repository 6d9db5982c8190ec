"""Probes: one-question measurements of one part (a kernel, the IPC path, a CPU's peaks), see README.md."""

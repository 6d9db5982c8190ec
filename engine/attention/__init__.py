"""Attention backends (engine/attention/backend.py is their interface): torch, the C++ CPU
kernels' (handed their compiled module) and Triton's. Which one a runner uses is chosen in
engine/worker/attention_choice.py; nothing here imports the CPU wing."""

from __future__ import annotations

BACKEND_NAMES = ("torch", "cpu", "triton")

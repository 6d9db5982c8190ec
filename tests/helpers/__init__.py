"""What the tests share: tiny models and the default model (models), a live server, /metrics and
waiting (server), scheduler factories (scheduler); GGUF files are written by scripts/lib/gguf_writer.py.

The fake engine core and the frontend-in-a-subprocess harness live in scripts/lib/fake_engine.py,
since the IPC benchmark and the screenshots script use them too."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

"""The soak: `python -m scripts.soak.run` sends minutes of mixed traffic, then checks the server's end state."""

"""The hostile client: `python -m scripts.hostile.run` runs every case against a server it starts."""

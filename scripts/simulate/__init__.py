"""The capacity simulator's command line (`python -m scripts.simulate.run`) and its validation."""

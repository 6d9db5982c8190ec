"""The frontend <-> engine-core contract: message records, codec and sockets, and the
text logic both sides share (`ipc.text`). No torch here."""

from ipc.sampling_params import SamplingParams

__all__ = ["SamplingParams"]

"""The frontend <-> engine-core contract: message records, codec and sockets. No torch here."""

from ipc.sampling_params import SamplingParams

__all__ = ["SamplingParams"]

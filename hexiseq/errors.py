"""Exception classes: every failure HexiSeq reports is a subclass of HexiseqError."""

__all__ = [
    "HexiseqError",
    "InvalidArgumentError",
    "UnknownGPUError",
    "LayoutError",
    "MemoryFitError",
    "UnsupportedError",
    "CudaError",
    "InternalError",
]


class HexiseqError(Exception):
    """Base class of every error raised by HexiSeq."""


class InvalidArgumentError(HexiseqError, ValueError):
    """An input has a value out of its domain; the message names the field and the value."""


class UnknownGPUError(InvalidArgumentError):
    """A GPU model not in the catalog; the message lists the known models."""


class LayoutError(InvalidArgumentError):
    """A plan layout is inconsistent: shares that don't add up, overlapping heads, a device twice."""


class MemoryFitError(HexiseqError):
    """No plan fits in device memory; the message names the device that is short and by how many GiB."""


class UnsupportedError(HexiseqError):
    """A valid request that this strategy or build cannot serve."""


class CudaError(HexiseqError):
    """A CUDA runtime call failed."""


class InternalError(HexiseqError):
    """An internal invariant did not hold: a bug, please report it."""

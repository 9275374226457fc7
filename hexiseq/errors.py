"""Exception classes: every failure HexiSeq reports is a subclass of HexiseqError."""

__all__ = [
    "HexiseqError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownGPUError",
    "LayoutError",
    "RankMismatchError",
    "MemoryFitError",
    "UnsupportedError",
    "CudaError",
    "InternalError",
]


class HexiseqError(Exception):
    """Base class of every error raised by HexiSeq."""


class InvalidArgumentError(HexiseqError, ValueError):
    """An input has a value out of its domain; the message names the field and the value."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An input of the wrong kind (a list where a tensor goes, a string where a number goes); the message names the
    field and what it got. Also a TypeError, so code that catches the built-in type error still does."""


class UnknownGPUError(InvalidArgumentError):
    """A GPU model not in the catalog; the message lists the known models."""


class LayoutError(InvalidArgumentError):
    """A plan layout is inconsistent: shares that don't add up, overlapping heads, a device twice."""


class RankMismatchError(InvalidArgumentError):
    """Ranks executing a plan together disagree about it or about a call (the plan, batch, head dim, dtype,
    causal, softmax scale, whether a backward follows); raised with the same message on every rank, which names
    the field and each rank's value."""


class MemoryFitError(HexiseqError):
    """No plan fits in device memory; the message names the device that is short and by how many GiB.

    Raised by hexiseq.plan, it also says what would fit, as fields (None where not worked out):
      states_gib: model states (parameters, gradients, optimizer states) per device under the plan's sharding,
          a list by device; they do not depend on the sequence;
      states_fit: whether every device can hold its states (after the reserved memory) at all;
      longest_seq_len: the longest sequence that fits with the same training settings (a multiple of 1024), or
          0 when none does;
      longest_seq_len_checkpointing: the same with full activation checkpointing (equal to longest_seq_len when
          the plan already checkpoints)."""

    def __init__(self, message, *, states_gib=None, states_fit=None, longest_seq_len=None,
                 longest_seq_len_checkpointing=None):
        super().__init__(message)
        self.states_gib = states_gib
        self.states_fit = states_fit
        self.longest_seq_len = longest_seq_len
        self.longest_seq_len_checkpointing = longest_seq_len_checkpointing


class UnsupportedError(HexiseqError):
    """A valid request that this strategy or build cannot serve."""


class CudaError(HexiseqError):
    """A CUDA runtime call failed."""


class InternalError(HexiseqError):
    """An internal invariant did not hold: a bug, please report it."""

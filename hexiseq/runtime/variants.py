"""The attention variants a layer may ask for beside causal masking and documents: a sliding window and logit
soft-capping (both applied inside every block pair by the kernels, see hexiseq.ops.attention_forward), and sink
logits (folded once per row after the ring, see hexiseq.ops.fold_sinks_). A Variant is one layer's choice; layers of
one model may differ (local and global layers), so it travels with each call, not with the context.
"""

from typing import NamedTuple, Optional, Tuple

from . import ops


class Variant(NamedTuple):
    """window: (left, right) as hexiseq.ops takes it (-1: no bound on that side), or None; softcap: > 0, or None."""

    window: Optional[Tuple[int, int]] = None
    softcap: Optional[float] = None

    @property
    def plain(self):
        return self.window is None and self.softcap is None

    def kwargs(self):
        """The keyword arguments of hexiseq.ops' attention calls."""
        return {"window": self.window, "softcap": self.softcap}

    def describe(self):
        """A short text for the call agreement (every rank must ask for the same variant)."""
        return "" if self.plain else f" window={self.window} softcap={self.softcap}"

    def sees(self, causal, q_pos0, q_len, k_pos0, k_len):
        """Whether any query of positions [q_pos0, q_pos0 + q_len) sees any key of [k_pos0, k_pos0 + k_len) under
        the causal mask and the window (documents aside): a pair that sees nothing is neither computed nor merged.
        Visible offsets q - k lie in [-right, left]; the pair's offsets in [q_first - k_last, q_last - k_first]."""
        if q_len == 0 or k_len == 0:
            return False
        lo, hi = q_pos0 - (k_pos0 + k_len - 1), q_pos0 + q_len - 1 - k_pos0
        left, right = self.window if self.window is not None else (-1, -1)
        if causal:
            right = 0  # the diagonal: a causal window_right is -1 or 0
        return (right < 0 or hi >= -right) and (left < 0 or lo <= left)


PLAIN = Variant()


def variant(window=None, softcap=None, causal=True):
    """A checked Variant (errors as hexiseq.ops raises them, naming the argument and the value)."""
    left_right = ops.window_bounds(window, causal)
    cap = ops.softcap_value(softcap)
    return Variant(None if left_right == (-1, -1) else left_right, cap if cap > 0 else None)

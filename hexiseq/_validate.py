"""Type checks for user input, raising InvalidArgumentError messages that name the field and the value.

Range checks live in the C core (one source of truth); these only make sure the core gets numbers."""

import math
import numbers

from .errors import InvalidArgumentError


def integer(value, field, minimum=None):
    """An int (not a bool, not a float with a fraction), optionally >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InvalidArgumentError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{field} must be >= {minimum}, got {value}")
    return value


def number(value, field, positive=False, optional=False):
    """A real number; NaN and infinities are rejected; None allowed when optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgumentError(f"{field} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise InvalidArgumentError(f"{field} must be positive, got {value!r}")
    return value


def parse_tokens(value, field="seq_len"):
    """Token counts as people write them: 131072, "131072", "128k" (x1024), "1m" (x1024^2)."""
    if isinstance(value, str):
        text = value.strip().lower()
        scale = 1
        if text.endswith("k"):
            scale, text = 1024, text[:-1]
        elif text.endswith("m"):
            scale, text = 1024 * 1024, text[:-1]
        try:
            base = float(text)
        except ValueError:
            raise InvalidArgumentError(f"{field} must be a token count like 131072 or 128k, got {value!r}") from None
        if not math.isfinite(base) or base * scale != int(base * scale):
            raise InvalidArgumentError(f"{field} must be a whole number of tokens, got {value!r}")
        value = int(base * scale)
    value = integer(value, field)
    if value < 1:
        raise InvalidArgumentError(f"{field} must be >= 1, got {value}")
    if value > MAX_TOKENS:
        raise InvalidArgumentError(f"{field} must be <= {MAX_TOKENS} (2^30), got {value}")
    return value


MAX_TOKENS = 1 << 30  # the core's limit (HEXISEQ_MAX_SEQ_LEN): keeps its pair counts inside int64

"""Type checks for user input, raising InvalidArgumentError messages that name the field and the value.

Range checks live in the C core (one source of truth); these make sure the core gets numbers it can hold: a
C int (int32) unless a field says otherwise, integral values only, finite reals, real booleans."""

import json
import math
import numbers

import numpy as np

from . import _core
from .errors import InvalidArgumentError

INT32_MAX = 2**31 - 1
MAX_NESTING = 64  # deepest nesting of lists and mappings accepted in a description (calibration records, files)
MAX_ITEMS = 10_000_000  # entries of all its lists and mappings together (a 2048-device cluster's two matrices: 8.4M)


def short(value):
    """repr of a value for an error message, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(value, field, minimum=None, maximum=INT32_MAX):
    """An int (not a bool, not a float with a fraction), optionally >= minimum, and <= maximum (by default the
    largest C int: counts and sizes the core holds in 32 bits)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
            value = int(value)
        else:
            raise InvalidArgumentError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        if maximum is not None:
            raise InvalidArgumentError(f"{field} must be in [{minimum}, {maximum}], got {value}")
        raise InvalidArgumentError(f"{field} must be >= {minimum}, got {value}")
    if maximum is not None:
        lowest = minimum if minimum is not None else -maximum - 1  # the C type's own bound when none is given
        if not lowest <= value <= maximum:
            raise InvalidArgumentError(f"{field} must be in [{lowest}, {maximum}], got {value}")
    return value


def core_integer(value, field, name):
    """An integer in the range the core accepts for its input `name` (see hexiseq_int_range), e.g.
    core_integer(8, "nodes[1].count", "nodes.count")."""
    lo, hi = _core.int_range(name)
    return integer(value, field, lo, hi)


def boolean(value, field):
    """True or False (NumPy's too), or the integers 0 and 1; anything else (2, "no", None) is refused rather than
    read by its truth value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise InvalidArgumentError(f"{field} must be true or false, got {value!r}")


def number(value, field, positive=False, optional=False):
    """A real number; NaN and infinities are rejected; None allowed when optional."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{field} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range
        raise InvalidArgumentError(f"{field} must be a finite number, got {value!r}") from None
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgumentError(f"{field} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise InvalidArgumentError(f"{field} must be positive, got {value!r}")
    return value


def integers(value, field, minimum=None, maximum=INT32_MAX):
    """A list (or tuple, or 1-D array) of integers as a list of ints, each checked by `integer` under the name
    field[i]. NumPy integer arrays are range-checked at once."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidArgumentError(f"{field} must be a list of integers, got an array of shape {value.shape}")
        if value.dtype.kind in "iu" and value.size:
            lo, hi = int(value.min()), int(value.max())
            if (minimum is None or lo >= minimum) and (maximum is None or hi <= maximum):
                return [int(v) for v in value.tolist()]
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"{field} must be a list of integers, got {value!r}")
    if value and all(type(v) is int for v in value):  # plain ints (no bools): range-checked at once
        if (minimum is None or min(value) >= minimum) and (maximum is None or max(value) <= maximum):
            return list(value)
    return [integer(v, f"{field}[{i}]", minimum, maximum) for i, v in enumerate(value)]


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
    value = integer(value, field, maximum=None)
    if value < 1:
        raise InvalidArgumentError(f"{field} must be >= 1, got {value}")
    if value > MAX_TOKENS:
        raise InvalidArgumentError(f"{field} must be <= {MAX_TOKENS} (2^30), got {value}")
    return value


MAX_TOKENS = 1 << 30  # the core's limit (HEXISEQ_MAX_SEQ_LEN): keeps its pair counts inside int64


def document_lengths(value, seq_len, field="documents"):
    """Packed documents: their lengths in sequence order (a list, tuple, 1-D array or tensor of integers >= 1)
    adding up to seq_len, as a read-only int64 array; None stays None (one document per sequence)."""
    if value is None:
        return None
    if hasattr(value, "detach") and hasattr(value, "tolist"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if (isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu" and value.size
            and value.min() >= 1 and value.max() <= MAX_TOKENS):  # checked at once: re-planning runs per batch
        lengths = value.astype(np.int64)
    else:
        lengths = np.asarray(integers(value, field, 1, MAX_TOKENS), dtype=np.int64)
    if lengths.size == 0:
        raise InvalidArgumentError(f"{field} must hold at least one length, got {value!r}")
    total = int(lengths.sum())
    if total != seq_len:
        raise InvalidArgumentError(f"{field} must add up to seq_len={seq_len}, they add up to {total} "
                                   f"({lengths.size} length{'' if lengths.size == 1 else 's'})")
    lengths.setflags(write=False)
    return lengths


def nesting(value, field, limit=MAX_NESTING, max_items=MAX_ITEMS):
    """Refuse lists and mappings nested deeper than `limit` levels or holding more than `max_items` entries in all
    (a YAML file's aliases can make a few lines hold billions), checked without recursion, so that what reads,
    hashes or writes them later can neither run out of stack nor run for hours."""
    containers = (list, tuple, dict)
    stack, items = [(value, 1, "")] if isinstance(value, containers) else [], 0
    while stack:  # only containers are stacked; `under` is the top-level key they hang from
        item, depth, under = stack.pop()
        if depth > limit:
            raise InvalidArgumentError(f"{field} is nested too deeply (at most {limit} levels){under}")
        items += len(item)
        if items > max_items:
            raise InvalidArgumentError(f"{field} holds more than {max_items} entries")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((v, depth + 1, under or f" under {k!r}") for k, v in pairs if isinstance(v, containers))
    return value


def load_json(text, where):
    """json.loads for user files and strings: invalid JSON, undecodable bytes and documents nested too deeply all
    raise InvalidArgumentError naming `where`."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{where} is not JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise InvalidArgumentError(f"{where} is nested too deeply (at most {MAX_NESTING} levels)") from None
    except TypeError:
        raise InvalidArgumentError(f"{where} must be JSON text (str or bytes), got {type(text).__name__}") from None
    return nesting(doc, where)


def read_text(path, what):
    """The UTF-8 text of a user file; a missing, unreadable or non-UTF-8 file, or a path with a NUL character,
    raises InvalidArgumentError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    except ValueError:  # open()'s "embedded null byte": no file has such a name
        raise InvalidArgumentError(f"cannot read {what} {path!r}: a path must not contain a NUL character") from None

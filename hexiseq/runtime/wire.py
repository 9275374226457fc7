"""Values as the int64s the ranks compare in their agreements (one all-gather of a few integers, see
comm.agree), and back into words for the error that names a disagreement: a member of a table as its index, a
float as its exact bit pattern, a dtype by name. Shared by the call contract of `comm` and the sharding checks of
`states`."""

import struct

import torch

# the dtypes a rank may name; any other is coded len(DTYPES), "other"
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def code(table, value):
    """value's index in table, len(table) for a value not in it."""
    return table.index(value) if value in table else len(table)


def float_bits(x):
    """An exact int64 image of a float (or of None, as a NaN pattern no scale has)."""
    return struct.unpack("<q", struct.pack("<d", float("nan") if x is None else float(x)))[0]


def bits_float(b):
    """The float float_bits(x) was made from."""
    return struct.unpack("<d", struct.pack("<q", b))[0]


def dtype_name(value):
    """The name of the dtype code(DTYPES, dtype) gave ("bfloat16"), "other" for one outside DTYPES."""
    return str(DTYPES[value]).replace("torch.", "") if value < len(DTYPES) else "other"

"""Packed documents in the runtime: the lengths a call passes, checked by the planner's rules on every rank (the
error goes through the ranks' agreement, so all raise it together), and turned once per call into the absolute
document start of every query of the rank's group's chunks, which the block kernels take as q_doc."""

import numpy as np
import torch

from . import ops
from .._validate import document_lengths, short
from ..errors import InvalidArgumentError

# The keyword a Hugging Face model patched by hexiseq.hf takes the packed documents' lengths in (transformers hands
# a model's extra keywords down to every attention call): hexiseq.hf.shard_inputs and the batch passes set it.
DOCUMENTS_KWARG = "hexiseq_documents"


def frozen(value):
    """A copy of documents that later changes to the caller's lists cannot reach (the backward reads it): tensors
    and arrays as lists, lists as tuples, anything else as it is (validation words it)."""
    if isinstance(value, (int, torch.SymInt)):  # a length (symbolic under torch.compile, which traces this)
        return value
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist") and hasattr(value, "ndim"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(frozen(x) for x in value)
    return value


def check(documents, seq_len, causal, batch):
    """(the InvalidArgumentError these documents deserve or None, their lengths: a tuple of ints for the whole
    batch or a tuple of such tuples, one per batch row; None without documents)."""
    if documents is None:
        return None, None
    if not causal:
        return InvalidArgumentError("documents (a document mask) need a causal context (causal=True): a query "
                                    "sees the keys from its document's start up to itself"), None
    value = frozen(documents)
    if not isinstance(value, tuple) or not value:
        return InvalidArgumentError(f"documents must be a list of document lengths (ints > 0 adding up to the "
                                    f"plan's seq_len {seq_len}), or one such list per batch row, got "
                                    f"{short(documents)}"), None
    per_row = all(isinstance(row, tuple) for row in value)
    if per_row and len(value) != batch:
        return InvalidArgumentError(f"documents has {len(value)} lists (one per batch row) but the batch has "
                                    f"{batch} rows"), None
    try:  # the planner's rules for document lengths, with its messages
        rows = [document_lengths(row, seq_len, f"documents[{b}]" if per_row else "documents")
                for b, row in enumerate(value if per_row else (value,))]
    except InvalidArgumentError as e:
        return e, None
    lengths = tuple(tuple(row.tolist()) for row in rows)
    return None, lengths if per_row else lengths[0]


def chunk_starts(topo, rank, rows, device):
    """The document mask of `rank`'s group's query chunks (the plan's spans, in layout order), built once per call:
    per chunk (q_doc, earliest start), q_doc int64 [n] (one document list for the whole batch) or [B, n] (one per
    batch row) holding each query's absolute document start, as hexiseq.ops takes it. rows: the lengths, a tuple
    of ints or a tuple of such tuples (one per batch row). The earliest start lets a ring step skip a key block
    that ends before every query's document."""
    per_row = bool(rows) and isinstance(rows[0], tuple)
    out = []
    for p0, n in topo.chunks[topo.group_of(rank)]:
        pos = np.arange(p0, p0 + n, dtype=np.int64)
        starts = np.stack([ops.document_starts(r, pos) for r in rows]) if per_row else ops.document_starts(rows, pos)
        out.append((torch.from_numpy(starts).to(device), int(starts.min()) if n else 0))
    return out

"""Cases of hexiseq.ops that every backend must pass, one body each, run over the backends present
(tests/helpers/attention_backends.py): "cpu" always, "cuda" with a GPU and a CUDA build (skipped otherwise). Each
case table is per backend: the CPU cases run float64 at 1e-12, the CUDA cases bf16/fp16 under the 2x-torch rule.

Backend-specific tests stay in tests/test_ops.py (CPU: NumPy dtypes, torch SDPA in float64, scale, no-torch use)
and tests/test_cuda_ops.py (CUDA: shapes and head dims, long sequences, streams, errors, the runtime on a GPU).
"""

import math

import numpy as np
import torch

from hexiseq import ops
from reference import attention, attention_backward, visible
from attention_backends import case, over_backends

# ------------------------------------------------------------------------------------------------ causal offsets

# (q_pos0, k_pos0) of a 97-query block against a 61-key block
CPU_OFFSETS = {
    "q_before_k": (0, 200),        # every row fully masked
    "q_after_k": (300, 0),         # nothing masked
    "overlap_q_later": (50, 20),
    "overlap_k_later": (20, 50),   # the first rows fully masked
    "aligned": (37, 37),           # same block
}
# (q_pos0, k_pos0) as a function of (Sq, Sk), for 97 queries against 193 keys
CUDA_OFFSETS = {
    "aligned": lambda sq, sk: (0, 0),                 # same block (the diagonal)
    "q_after_k": lambda sq, sk: (sk + 5, 0),           # queries after every key: nothing masked
    "q_before_k": lambda sq, sk: (0, sq + 3),          # queries before every key: every row fully masked
    "overlap_q_later": lambda sq, sk: (50, 20),       # partly visible
    "overlap_k_later": lambda sq, sk: (0, 30),        # first 30 query rows fully masked
}

CAUSAL_OFFSET_CASES = dict(
    cpu=[case(name, shape=(2, 97, 61, 4, 2, 16), dtype=np.float64, seed=qp * 1000 + kp, pos=(qp, kp),
              forward=True, backward=True)
         for name, (qp, kp) in CPU_OFFSETS.items()],
    cuda=[case(f"{name}-forward-D{D}", shape=(2, 97, 193, 4, 4, D), dtype=torch.bfloat16, seed=1,
               pos=CUDA_OFFSETS[name](97, 193), forward=True, backward=False)
          for name in sorted(CUDA_OFFSETS) for D in (64, 128)]
    + [case(f"{name}-backward", shape=(2, 97, 193, 4, 2, 64), dtype=torch.bfloat16, seed=5,
            pos=CUDA_OFFSETS[name](97, 193), forward=False, backward=True)
       for name in sorted(CUDA_OFFSETS)],
)


@over_backends(**CAUSAL_OFFSET_CASES)
def test_causal_offsets(backend, case):
    """A query block against a key block at every relative placement: before, after, overlapping either way, the
    same positions; rows that see no key come out 0 / -inf with no gradient."""
    (q, k, v), gen = backend.make(case.shape, case.dtype, case.seed)
    if case.forward:
        backend.check_forward(q, k, v, True, *case.pos, what=case.name)
    if case.backward:
        backend.check_backward(q, k, v, True, *case.pos, gen, what=case.name)


# ------------------------------------------------------------------------------------------------ fully masked rows

FULLY_MASKED_CASES = dict(
    # keys at positions 4..8, queries 0..8: rows 0..3 see no key; then an empty key block
    cpu=[case("first-rows", shape=(1, 9, 5, 2, 2, 8), dtype=np.float64, seed=5, pos=(0, 4), dout="randn",
              empty_keys=True)],
    # every query before every key
    cuda=[case("all-rows", shape=(2, 64, 64, 4, 2, 64), dtype=torch.bfloat16, seed=11, pos=(0, 1000), dout="ones",
               empty_keys=False)],
)


@over_backends(**FULLY_MASKED_CASES)
def test_fully_masked_rows(backend, case):
    """Rows that see no key: out exactly 0, lse -inf, dq exactly 0; keys no row sees: dk, dv exactly 0; every
    gradient finite."""
    (q, k, v), gen = backend.make(case.shape, case.dtype, case.seed)
    kw = dict(causal=True, q_pos0=case.pos[0], k_pos0=case.pos[1])
    seen = visible(q.shape[1], k.shape[1], *case.pos, True, backend.device)
    dead, unseen = ~seen.any(1), ~seen.any(0)
    t = backend.tensor
    out, lse = ops.attention_forward(q, k, v, **kw)
    assert torch.all(t(lse)[:, :, dead] == -math.inf) and torch.all(torch.isfinite(t(lse)[:, :, ~dead]))
    assert torch.all(t(out)[:, dead] == 0)
    dout = torch.ones_like(q) if case.dout == "ones" else backend.randn(gen, q.shape)
    dq, dk, dv = (t(x) for x in ops.attention_backward(q, k, v, out, lse, dout, **kw))
    assert torch.all(dq[:, dead] == 0)
    assert torch.all(dk[:, unseen] == 0) and torch.all(dv[:, unseen] == 0)
    assert all(torch.all(torch.isfinite(x)) for x in (dq, dk, dv))
    if case.empty_keys:  # an empty key block: every row fully masked
        out, lse = ops.attention_forward(q, k[:, :0], v[:, :0])
        assert torch.all(t(out) == 0) and torch.all(t(lse) == -math.inf)


# ------------------------------------------------------------------------------------------------ split-KV merge

def random_cuts(n, parts):
    """parts + 1 boundaries 0 = c0 <= c1 <= ... = n at random places (blocks may be empty or single rows)."""
    def draw(rng):
        inner = np.sort(rng.integers(0, n + 1, size=parts - 1))
        return [0, *map(int, inner), n]
    return draw


SPLIT_KV_CASES = dict(
    # queries overlap the keys: the later key blocks are partly or fully masked for some rows. The backward pieces
    # add into one set of gradient buffers in place (accumulate=True; dk, dv through slices).
    cpu=[case(f"parts{parts}-{'causal' if causal else 'full'}", shape=(2, 97, 211, 8, 2, 16), dtype=np.float64,
              seed=parts * 10 + causal, causal=causal, q_pos0=150, cuts=random_cuts(211, parts), acc_dtype=np.float64,
              lse_dtype=np.float64, accumulate=True)
         for causal in (True, False) for parts in (2, 3, 4, 5)],
    # three fixed blocks into an fp32 accumulator; each backward piece returns its own gradients
    cuda=[case("3blocks", shape=(2, 257, 300, 4, 2, 64), dtype=torch.bfloat16, seed=10, causal=True, q_pos0=100,
               cuts=lambda gen: [0, 97, 200, 300], acc_dtype=torch.float32, lse_dtype=torch.float32,
               accumulate=False)],
)


@over_backends(**SPLIT_KV_CASES)
def test_split_kv_merge_equals_unsplit(backend, case):
    """Forward over key blocks merged by merge_ equals the unsplit forward; backward of each block with the global
    out / lse sums to the unsplit gradients."""
    (q, k, v), gen = backend.make(case.shape, case.dtype, case.seed)
    B, Sq, Sk, H, Hkv, D = case.shape
    kw = dict(causal=case.causal, q_pos0=case.q_pos0)
    c = case.cuts(gen)
    acc = backend.zeros((B, Sq, H, D), case.acc_dtype)
    acc_lse = backend.zeros((B, H, Sq), case.lse_dtype)
    acc_lse[...] = -math.inf
    for a, b in zip(c[:-1], c[1:]):
        part_o, part_l = ops.attention_forward(q, k[:, a:b], v[:, a:b], k_pos0=a, **kw)
        assert ops.merge_(acc, acc_lse, part_o, part_l) is None
    out, lse = backend.check_merged(acc, acc_lse, q, k, v, dict(kw, k_pos0=0))

    dout = backend.split_dout(gen, q)
    full = ops.attention_backward(q, k, v, out, lse, dout, k_pos0=0, **kw)
    if case.accumulate:
        dq, dk, dv = (backend.zeros(x.shape, x.dtype) for x in (q, k, v))
        for a, b in zip(c[:-1], c[1:]):
            ops.attention_backward(q, k[:, a:b], v[:, a:b], out, lse, dout, k_pos0=a, dq=dq, dk=dk[:, a:b],
                                   dv=dv[:, a:b], accumulate=True, **kw)
    else:  # dq: the pieces summed in float32; dk, dv: each block's slice
        dq, dks, dvs = backend.zeros(q.shape, torch.float32), [], []
        for a, b in zip(c[:-1], c[1:]):
            dqb, dkb, dvb = ops.attention_backward(q, k[:, a:b], v[:, a:b], out, lse, dout, k_pos0=a, **kw)
            dq += dqb.float()
            dks.append(dkb)
            dvs.append(dvb)
        dk, dv = torch.cat(dks, 1), torch.cat(dvs, 1)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), full):
        backend.check_split_grad(name, got, ref)


# ------------------------------------------------------------------------------------------------ merge

MERGE_CASES = dict(
    # float16 partials into a float32 accumulator; checked against the float64 log-sum-exp formula
    cpu=[case("f32+f16", shape=(1, 13, 2, 8), seed=11, acc=(np.float32, np.float32), part=(np.float16, np.float32),
              acc_dead=slice(5, 7), part_dead=slice(0, 3), acc_nan=None, tol=1e-6, exact_rows=True)],
    # checked against the CPU kernel on the same values (within tol: no bitwise row checks)
    cuda=[case(f"{str(a).split('.')[1]}+{str(p).split('.')[1]}", shape=(2, 97, 3, 80), seed=12,
               acc=(a, torch.float64 if a == torch.float64 else torch.float32),
               part=(p, torch.float64 if p == torch.float64 else torch.float32),
               acc_dead=slice(0, 10), part_dead=slice(5, 15), acc_nan=slice(0, 5),
               tol={torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3}[a], exact_rows=False)
          for a, p in [(torch.float32, torch.bfloat16), (torch.float16, torch.float16), (torch.float64, torch.float32)]],
)


@over_backends(**MERGE_CASES)
def test_merge(backend, case):
    """merge_ of a partial into an accumulator of another dtype, with rows where either side saw no key (lse = -inf):
    a partial that saw no key leaves the accumulator unchanged, an empty accumulator takes the partial, both empty
    stays empty, and the accumulator's out is never read where its lse is -inf."""
    B, S, H, D = case.shape
    g = backend.gen(case.seed)
    oa = backend.randn(g, (B, S, H, D), case.acc[0])
    op = backend.randn(g, (B, S, H, D), case.part[0])
    la = backend.randn(g, (B, H, S), case.acc[1])
    lp = backend.randn(g, (B, H, S), case.part[1])
    la[:, :, case.acc_dead] = -math.inf
    lp[:, :, case.part_dead] = -math.inf
    if case.acc_nan is not None:
        oa[:, case.acc_nan] = math.nan
    t = backend.tensor
    o0, l0 = t(oa).clone(), t(la).clone()
    want = backend.merge_expected(oa, la, op, lp)
    assert ops.merge_(oa, la, op, lp) is None
    backend.check_merge(oa, la, want, case.tol)
    rows = torch.arange(S, device=backend.device)
    acc_dead = (rows >= case.acc_dead.start) & (rows < case.acc_dead.stop)
    part_dead = (rows >= case.part_dead.start) & (rows < case.part_dead.stop)
    assert torch.all(t(la)[:, :, acc_dead & part_dead] == -math.inf)  # both -inf: unchanged
    if case.exact_rows:
        keep, take = part_dead & ~acc_dead, acc_dead & ~part_dead
        # a partial that saw no key leaves the accumulator bit-for-bit unchanged
        assert torch.equal(t(oa)[:, keep], o0[:, keep]) and torch.equal(t(la)[:, :, keep], l0[:, :, keep])
        assert torch.equal(t(oa)[:, take], t(op)[:, take].to(o0.dtype))  # an empty accumulator takes the partial


# ------------------------------------------------------------------------------------------------ document mask

DOC_LENGTHS = [1, 120, 1, 1, 230, 47]  # the long document reaches from the back chunk into the first keys
# (query positions, key positions) of a block pair; the queries' starts are those of their own positions
DOC_BLOCKS = {"zigzag-back-chunk": ((300, 400), (0, 150)), "ring-step": ((150, 250), (100, 250)),
              "diagonal": ((0, 97), (0, 97))}

DOCUMENT_BLOCK_CASES = dict(
    cpu=[case(name, shape=(2, qr[1] - qr[0], kr[1] - kr[0], 4, 1, 8), dtype=np.float64, seed=qr[0] + 7 * kr[0],
              q_range=qr, k_range=kr)
         for name, (qr, kr) in DOC_BLOCKS.items()],
    cuda=[case(f"{name}-D{D}", shape=(2, qr[1] - qr[0], kr[1] - kr[0], 4, 2, D), dtype=dtype, seed=3, q_range=qr,
               k_range=kr)
          for name, (qr, kr) in DOC_BLOCKS.items() for D, dtype in ((64, torch.bfloat16), (128, torch.float16))],
)


@over_backends(**DOCUMENT_BLOCK_CASES)
def test_document_mask_blocks(backend, case):
    """Blocks from anywhere in the sequence with the starts of their own positions ([seq_q]: one layout for the
    batch), against the reference on the same blocks: forward, then backward."""
    q_doc = ops.document_starts(DOC_LENGTHS, positions=np.arange(*case.q_range))
    if backend.name == "cuda":
        q_doc = torch.from_numpy(q_doc).to(backend.device)
    (q, k, v), gen = backend.make(case.shape, case.dtype, case.seed)
    pos = (case.q_range[0], case.k_range[0])
    assert visible(q.shape[1], k.shape[1], *pos, True, "cpu", torch.as_tensor(q_doc).cpu()).any()  # some row sees
    backend.check_forward(q, k, v, True, *pos, what=case.name, q_doc=q_doc)
    backend.check_backward(q, k, v, True, *pos, gen, what=case.name, q_doc=q_doc)


# ------------------------------------------------------------------------------------------------ attention variants

# Sliding windows, soft-capping and sinks: name -> (causal, (q_pos0, k_pos0), window, softcap, sinks, documents),
# on a 97-query block against a block of Sk keys. amp scales q and k so that soft-capping saturates on part of the
# scores (tanh near its asymptote, where a wrong derivative shows).
VARIANTS = {
    "window-diagonal": (True, (0, 0), (5, 0), None, False, False),           # a window narrower than any tile
    "window-zero": (True, (0, 0), (0, 0), None, False, False),               # each query sees only itself
    "window-ring-step": (True, (150, 100), (30, -1), None, False, False),   # later rows see nothing (0 / -inf)
    "window-wide": (True, (64, 0), (100, 0), None, False, False),           # a window spanning several tiles
    "window-both-sides": (False, (0, 0), (7, 11), None, False, False),
    "window-right-only": (False, (20, 0), (-1, 3), None, False, False),
    "window-left-only": (False, (0, 40), (9, -1), None, False, False),      # the first rows see nothing
    "window-documents": (True, (300, 150), (40, 0), None, False, True),    # the later of window and document start
    "softcap": (True, (0, 0), None, 2.0, False, False),
    "softcap-full": (False, (0, 0), None, 30.0, False, False),
    "softcap-window-sinks": (True, (10, 0), (12, 0), 5.0, True, False),
    "sinks-rows-see-nothing": (True, (0, 120), None, None, True, False),   # the first rows: the sink alone
}
VARIANT_DOCS = [1, 120, 1, 1, 230, 47]


def _variant_case(name, backend, dtype, D, Sk, **extra):
    causal, pos, window, softcap, sinks, docs = VARIANTS[name]
    return case(f"{name}-{str(dtype).split('.')[-1]}-D{D}" if backend == "cuda" else name,
                shape=(2, 97, Sk, 4, 2, D), dtype=dtype, causal=causal, pos=pos, window=window, softcap=softcap,
                sinks=sinks, docs=docs, amp=3.0 if softcap else 1.0, **extra)


VARIANT_CASES = dict(
    cpu=[_variant_case(name, "cpu", np.float64, 16, 193) for name in VARIANTS],
    cuda=[_variant_case(name, "cuda", dtype, D, 193) for name in VARIANTS
          for dtype, D in ((torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256))]
    # D = 128 runs the staged backward by default; the register backward on the same cases
    + [_variant_case(name, "cuda", torch.bfloat16, 128, 193, backward_kernel="register")
       for name in ("window-ring-step", "window-documents", "softcap-window-sinks")],
)


@over_backends(**VARIANT_CASES)
def test_attention_variants(backend, case, monkeypatch):
    """Sliding windows (left, right, both; causal and not; with documents), logit soft-capping and sink logits,
    alone and together, at ring offsets where some rows see nothing: forward, then backward (the sinks' gradient
    included), against the float64 reference."""
    if getattr(case, "backward_kernel", None):
        monkeypatch.setenv("HEXISEQ_CUDA_BACKWARD", case.backward_kernel)
    (q, k, v), gen = backend.make(case.shape, case.dtype, case.seed if hasattr(case, "seed") else 11)
    q, k = q * case.amp, k * case.amp
    variant = dict(window=case.window, softcap=case.softcap)
    if case.sinks:
        sinks = np.array([0.5, -1.0, 2.0, 0.0])
        variant["sinks"] = sinks if backend.name == "cpu" else torch.tensor(sinks, device=backend.device)
    q_doc = None
    if case.docs:
        q_doc = ops.document_starts(VARIANT_DOCS, positions=np.arange(case.pos[0], case.pos[0] + q.shape[1]))
        q_doc = q_doc if backend.name == "cpu" else torch.from_numpy(q_doc).to(backend.device)
    backend.check_forward(q, k, v, case.causal, *case.pos, what=case.name, q_doc=q_doc, **variant)
    backend.check_backward(q, k, v, case.causal, *case.pos, gen, what=case.name, q_doc=q_doc, **variant)


def test_variant_refusals():
    """Bad windows and caps are refused with the argument and the value named."""
    q = np.zeros((1, 4, 2, 8))
    for kw, words in ((dict(window=(3, 2)), "right bound must be -1 or 0"),
                      (dict(window=(-2, 0)), "window left bound must be -1"),
                      (dict(window=5), "window must be None or a pair"),
                      (dict(window=(1.5, 0)), "window[left] must be an int"),
                      (dict(softcap=-1.0), "softcap must be finite and >= 0"),
                      (dict(softcap=math.inf), "softcap must be finite"),
                      (dict(sinks=np.zeros(3)), "sinks must have shape [heads] = [2]")):
        try:
            ops.attention_forward(q, q, q, **kw)
        except (ValueError, TypeError) as e:
            assert words in str(e), (kw, str(e))
        else:
            raise AssertionError(f"{kw} was accepted")


# ------------------------------------------------------------------------------------------------ NaN and infinities

# (q row, k row) a poison lands on; the query and key blocks are 67 x 67 at (q_pos0, k_pos0) = (0, 10) when causal:
# rows 0..9 see no key (they must stay 0 / -inf), key row 20 is seen by query rows 30.., query row 40 sees keys.
POISONS = {"q-nan": ("q", 40, math.nan), "k-nan": ("k", 20, math.nan), "q-inf": ("q", 40, math.inf),
           "k-inf": ("k", 20, math.inf)}
# finite entries against the float64 reference: max |x - ref| <= tol * max |ref| (accuracy is held tightly by the
# other tables; these bounds only catch a row computed wrongly around the poison)
NONFINITE_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}

NONFINITE_CASES = dict(
    cpu=[case(f"{poison}-{str(dtype)[6:]}-{mask}", shape=(2, 67, 67, 4, 2, 16), dtype=dtype, poison=poison,
              causal=mask == "causal", pos=(0, 10) if mask == "causal" else (0, 0), piece=None)
         for dtype in (torch.float64, torch.float32, torch.bfloat16) for poison in POISONS
         for mask in ("causal", "full")]
    # more keys than one piece (PIECE_TILES = 32 key tiles of 64, each piece folded into double): a NaN query row
    # NaN in every piece; a NaN key in the second piece, after a finite first one, seen by the later rows only
    + [case(f"{poison}-float32-pieces", shape=(1, 45, 2200, 2, 1, 16), dtype=torch.float32, poison=poison,
            causal=True, pos=(2100, 0), piece=None, row=2120 if poison == "k-nan" else None)
       for poison in ("q-nan", "k-nan")],
    cuda=[case(f"{poison}-{str(dtype)[6:]}-D{D}-{mask}", shape=(2, 67, 67, 4, 2, D), dtype=dtype, poison=poison,
               causal=mask == "causal", pos=(0, 10) if mask == "causal" else (0, 0), piece=None)
          for dtype, D in ((torch.bfloat16, 64), (torch.float16, 128)) for poison in POISONS
          for mask in ("causal", "full")]
    # the forward's key-block split (pieces of 64 keys merged in double), forced on a short block
    + [case(f"{poison}-bfloat16-split", shape=(1, 130, 300, 4, 2, 64), dtype=torch.bfloat16, poison=poison,
            causal=True, pos=(200, 0), piece="64") for poison in ("q-nan", "k-nan")],
)


def _poisoned(backend, case):
    B, Sq, Sk, H, Hkv, D = case.shape
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(B, n, h, D, generator=g, dtype=torch.float64) for n, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv)))
    which, row, value = POISONS[case.poison]
    row = getattr(case, "row", None) or row
    (q if which == "q" else k)[0, row, 1 if which == "q" else 0, 3] = value
    dout = torch.randn(B, Sq, H, D, generator=g, dtype=torch.float64)
    return [x.to(backend.device, case.dtype) for x in (q, k, v, dout)]


@over_backends(**NONFINITE_CASES)
def test_nonfinite_inputs_propagate(backend, case, monkeypatch):
    """A NaN or an infinity in q or k reaches the outputs it reaches in the float64 reference (torch's arithmetic):
    the rows that see it come out NaN (LSE not finite), exactly as in the reference; rows that see no key stay
    O = 0, LSE = -inf; every other entry is finite and correct. Gradients: every gradient row (a query's dq, a
    key's dk, dv, per head) that the reference makes NaN in every component is NaN, and no entry is NaN that the
    reference leaves a number. Between the two lie the entries a poisoned component reaches only through a zero
    factor (dS = 0 on a masked key times a NaN in q: 0 x NaN), which the reference's full matrix products make NaN
    and a tiled kernel makes NaN or not depending on whether it computes that tile (torch's flash kernels alike)."""
    if case.piece is not None:
        monkeypatch.setenv("HEXISEQ_CUDA_FORWARD_PIECE", case.piece)
    q, k, v, dout = _poisoned(backend, case)
    kw = dict(causal=case.causal, q_pos0=case.pos[0], k_pos0=case.pos[1])
    out, lse = ops.attention_forward(q, k, v, **kw)
    ref_out, ref_lse = attention(q, k, v, **kw)
    tol = NONFINITE_TOL[case.dtype]

    def same(got, ref, what, nonfinite, grad=False):
        got, ref = got.double().cpu(), ref.double().cpu()
        bad, want = nonfinite(got), nonfinite(ref)
        if grad:
            must = want.all(-1, keepdim=True).expand_as(want)
            assert must.any(), f"{what}: the poison must reach some gradient row in this case"
            assert torch.all(bad[must]), f"{what}: {int((~bad[must]).sum())} entries are numbers in rows of NaN"
            assert not torch.any(bad & ~want), f"{what}: {int((bad & ~want).sum())} NaN the reference leaves numbers"
        else:
            assert torch.equal(bad, want), (
                f"{what}: {int(bad.sum())} non-finite entries where the reference has {int(want.sum())}")
        fin = torch.isfinite(ref) & torch.isfinite(got)
        assert fin.any() or grad, what  # (a NaN query row seen by every key of a single kv head: all of dk NaN)
        err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
        assert err <= tol * max(ref[fin].abs().max().item() if fin.any() else 0.0, 1.0), f"{what}: error {err:.3g}"

    assert torch.isnan(ref_out).any(), "the poison must reach some row in this case"
    same(out, ref_out, "out", torch.isnan)
    same(lse, ref_lse, "lse", lambda x: ~torch.isfinite(x))
    if case.causal:
        dead = ~visible(q.shape[1], k.shape[1], *case.pos, True).any(1)
        assert torch.all(lse[:, :, dead] == -math.inf) and torch.all(out[:, dead] == 0)
    grads = ops.attention_backward(q, k, v, out, lse, dout, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, attention_backward(q, k, v, out, lse, dout, **kw)):
        same(g, r, name, torch.isnan, grad=True)

"""The attention reference of the Python tests: softmax attention written plainly with torch ops, on NumPy arrays or
torch tensors, with the kernels' semantics (csrc/attention/attention.h):

  O = softmax(scale Q K^T + mask) V per (batch, query head); query head h reads kv head h // (heads / kv_heads)
  (GQA, MQA); query row i sits at position q_pos0 + i, key row j at k_pos0 + j, and under the causal mask key j is
  visible to query i iff k_pos0 + j <= q_pos0 + i; with a document mask q_doc ([B, Sq] or [Sq] absolute starts), key j
  is visible to query i of batch b iff q_doc[b, i] <= k_pos0 + j <= q_pos0 + i. LSE is the natural log of the row sum
  of exp(scores). A row that sees no key: O = 0, LSE = -inf, no gradient.

Variants (the same header): a sliding window (left, right) keeps key j for query i only if qpos - kpos <= left and
kpos - qpos <= right (-1: no bound on that side); soft-capping turns each score x = scale q.k into
softcap tanh(x / softcap); sinks [H] add exp(sinks[h]) to each row's softmax denominator (a column with no value).

`attention` is the forward (float64 by default: the reference; in a low-precision dtype it is the baseline that
FlashAttention's tests call attention_ref(upcast=False)), differentiable when given tensors that require grad.
`attention_backward` is the closed-form backward from a given O and LSE, as the kernels define theirs.
"""

import math

import numpy as np
import torch


def visible(sq, sk, q_pos0, k_pos0, causal, device="cpu", q_doc=None, window=None):
    """[sq, sk] bool: key j visible to query i; with q_doc (document starts, [B, sq] or [sq]) [B, 1, sq, sk] or
    [sq, sk], the causal mask cut at each query's document start; window: (left, right) bounds, see above."""
    qp = q_pos0 + torch.arange(sq, device=device)
    kp = k_pos0 + torch.arange(sk, device=device)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        mask = kp[None, :] <= qp[:, None]
    if window is not None:
        left, right = window
        if left >= 0:
            mask = mask & (qp[:, None] - kp[None, :] <= left)
        if right >= 0:
            mask = mask & (kp[None, :] - qp[:, None] <= right)
    if q_doc is None:
        return mask
    doc = torch.as_tensor(q_doc).to(device, torch.int64)
    mask = mask & (kp[None, :] >= doc[..., :, None])  # [.., sq, sk]: from each query's document start
    return mask[:, None] if mask.dim() == 3 else mask


def _tensor(x, dtype):
    """x as a torch tensor of `dtype` (a NumPy array through float64, which holds every NumPy float exactly)."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x, np.float64))  # a copy: NumPy views may run backwards
    return x.to(dtype)


def _heads_major(x, dtype, group):
    """[B, S, A, D] -> [B, A * group, S, D] in dtype, each head repeated `group` times (kv heads to query heads)."""
    x = _tensor(x, dtype).transpose(1, 2)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _merge(acc, part):
    """(O, LSE) of two disjoint key sets folded by log-sum-exp; a side with LSE = -inf contributes nothing."""
    (oa, la), (op, lp) = acc, part
    ln = torch.logaddexp(la, lp)
    safe = torch.where(torch.isinf(ln), torch.zeros_like(ln), ln)  # both -inf: the row stays O = 0, LSE = -inf
    wa = torch.exp(la - safe).transpose(1, 2)[..., None]
    wp = torch.exp(lp - safe).transpose(1, 2)[..., None]
    return oa * wa + op * wp, ln


def attention(q, k, v, *, causal=False, q_pos0=0, k_pos0=0, scale=None, dtype=torch.float64, key_chunk=None,
              q_doc=None, window=None, softcap=None, sinks=None):
    """(out [B, Sq, H, D], lse [B, H, Sq]) of q [B, Sq, H, D], k, v [B, Sk, Hkv, D], computed with torch ops in
    `dtype` on q's device (lse in float32 below float64, as the kernels give it). scale: default 1 / sqrt(D).
    NumPy inputs give float64 NumPy results. key_chunk: compute the keys that many at a time and fold the pieces
    (memory of key blocks too long for one score matrix; float64 only)."""
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    if key_chunk is not None and k.shape[1] > key_chunk:
        assert sinks is None, "key_chunk: fold sinks once, after the pieces"
        acc = None
        for j in range(0, k.shape[1], key_chunk):
            part = attention(q, k[:, j:j + key_chunk], v[:, j:j + key_chunk], causal=causal, q_pos0=q_pos0,
                             k_pos0=k_pos0 + j, scale=scale, dtype=dtype, q_doc=q_doc, window=window,
                             softcap=softcap)
            part = tuple(_tensor(x, dtype) for x in part)
            acc = part if acc is None else _merge(acc, part)
        return tuple(x.numpy() for x in acc) if isinstance(q, np.ndarray) else acc
    Sq, H = q.shape[1], q.shape[2]
    Sk, Hkv = k.shape[1], k.shape[2]
    qq = _heads_major(q, dtype, 1)                                          # [B, H, Sq, D]
    kk, vv = _heads_major(k, dtype, H // Hkv), _heads_major(v, dtype, H // Hkv)  # [B, H, Sk, D]
    mask = visible(Sq, Sk, q_pos0, k_pos0, causal, qq.device, q_doc, window)  # [Sq, Sk] or [B, 1, Sq, Sk]
    s = (qq * scale) @ kk.transpose(-1, -2)                                 # [B, H, Sq, Sk]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if sinks is not None:  # one more column per row: the sink's logit, always visible, with a zero value row
        B = s.shape[0]
        sink = _tensor(sinks, dtype).to(s.device).reshape(1, H, 1, 1).expand(B, H, Sq, 1)
        s = torch.cat([s, sink], -1)
        vv = torch.cat([vv, torch.zeros_like(vv[:, :, :1])], 2)
        mask = torch.cat([mask, torch.ones_like(mask[..., :1])], -1)
    dead = ~mask.any(-1)                                                    # [Sq] ([B, 1, Sq]) rows that see no key
    s = s.masked_fill(~mask, -math.inf).masked_fill(dead[..., None], 0.0)   # dead rows: 0, so no NaN below
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1).masked_fill(~mask, 0.0)
    out = (p @ vv).transpose(1, 2)
    lse = lse.masked_fill(dead, -math.inf)
    if isinstance(q, np.ndarray):
        return out.numpy(), lse.numpy()
    return out, lse


def attention_backward(q, k, v, out, lse, dout, *, causal=False, q_pos0=0, k_pos0=0, scale=None, q_doc=None,
                       window=None, softcap=None):
    """float64 (dq, dk, dv) from the given out and lse (not recomputed), as the kernels define it:
    P = exp(scale Q K^T - LSE) masked, D = rowsum(dO * O), dS = P (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q,
    dV = P^T dO, with dK and dV summed over each kv head's query heads; with softcap the capped scores in P and dS
    times 1 - tanh^2. NumPy inputs give NumPy results."""
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    f64 = torch.float64
    qq, oo, do = (_heads_major(x, f64, 1) for x in (q, out, dout))  # [B, H, Sq, D]
    kk, vv = _heads_major(k, f64, g), _heads_major(v, f64, g)        # [B, H, Sk, D]
    ll = _tensor(lse, f64)
    mask = visible(Sq, Sk, q_pos0, k_pos0, causal, qq.device, q_doc, window)
    s = qq @ kk.transpose(-1, -2) * scale
    dcap = 1.0
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    s = s.masked_fill(~mask, -math.inf)
    ll = torch.where(ll == -math.inf, torch.full_like(ll, math.inf), ll)  # rows that see no key: P = 0
    p = torch.exp(s - ll[..., None]).masked_fill(~mask, 0.0)  # a NaN row (lse NaN) is NaN on its visible keys only
    delta = (do * oo).sum(-1, keepdim=True)
    ds = (p * (do @ vv.transpose(-1, -2) - delta) * dcap).masked_fill(~mask, 0.0)
    dq = (ds @ kk * scale).transpose(1, 2)
    dk = (ds.transpose(-1, -2) @ qq * scale).reshape(B, Hkv, g, Sk, D).sum(2).transpose(1, 2)
    dv = (p.transpose(-1, -2) @ do).reshape(B, Hkv, g, Sk, D).sum(2).transpose(1, 2)
    if isinstance(q, np.ndarray):
        return dq.numpy(), dk.numpy(), dv.numpy()
    return dq, dk, dv

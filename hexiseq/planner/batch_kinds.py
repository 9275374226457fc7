"""The cost of one kind of group in a batch plan (hexiseq.planner.batch): how long a packed pass of S tokens whose
documents leave P query-key pairs visible takes on it, priced f + a S + b P from base layouts the scheduler makes
for the group, and the exact score of a pass. Groups of equal description (hexiseq.planner.batch's candidate tree
has many of them) share one GroupKind, made on first use."""

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import InvalidArgumentError, MemoryFitError, UnsupportedError
from .packing import visible_pairs
from .plan import FIT_PROBE_S, memory_tokens_bound, plan_layout, plan_one, strategy_of


def _short_docs(S, d):
    return [d] * (S // d) + ([S % d] if S % d else [])


class GroupKind:
    """One kind of group (groups of equal description share one): how long a packed pass takes on it.

    `longest`: the most tokens one pass holds (the longest single sequence the scheduler fits, found by bisection to
    0.4%). Base layouts: the scheduler's plans for a pass of S_ref tokens, as one document and as documents of 2,048
    tokens (a ring for the one, all-to-alls for the other, typically), at S_ref = longest / 1, 4, 16 and 64 (a
    layout made for a million tokens is a poor one for ten thousand). Under a base, a pass of S
    tokens whose documents leave P query-key pairs visible is priced f + a S + b P, with f, a, b >= 0 fitted by least
    squares to the cost model's figures for the base re-balanced to nine passes (S_ref / 16, S_ref / 4 and S_ref
    tokens, each as short documents, one document, and half one document): work linear in tokens (GEMMs,
    all-to-alls, the ring's traffic, which packed documents still send whole) and attention linear in visible pairs,
    which is how the cost model prices a layout whose split is re-balanced.
    Per step a kind prices with the bases made for the pass size it can expect (its devices' share of the batch's
    tokens), keeping the one of the two that prices a pass of that share of the batch lower; bases are made on first
    use."""

    SHORT = 256      # tokens per document of the "short documents" calibration batch
    TYPICAL = 2048   # tokens per document of the all-to-all base
    SCALES = (1, 4, 16, 64)

    def __init__(self, cluster, model, training, causal, threads=1):
        self.cluster, self.model, self.training, self.causal = cluster, model, training, causal
        # the same training without memory features: where the bases are planned and priced (what the features add,
        # tiles and copies, is not linear in the tokens; and with them a kind holds far longer sequences than a
        # batch's passes, bases planned there would be priced far from the passes they price)
        self.plain = dataclasses.replace(training, memory_features="none")
        self.longest = None  # the longest sequence the kind holds (with the features): its capacity
        self.anchor = None   # the same without them: where the bases are planned
        self._bases = {}  # scale -> [(Plan, f, a, b), ...]
        self.correction = 1.0  # exact / linear, learnt from exactly scored plans (BatchPlanner._learn)
        self._bounds = {}  # Training -> memory_tokens_bound
        self.threads = threads  # how many of the kind's own plans may run side by side

    def _fits(self, L, training):
        # the scheduler alone: plan() would also work out, for the error it raises, the longest sequence that fits
        # (a search of its own per probe, which made pricing 8,192 devices take minutes); and stopped at its first
        # plan that fits (FIT_PROBE_S): the scheduler's clock stops a search only once it holds a plan that fits, so
        # the answer is the full search's, without the search for the fastest (4-9x less per probe that fits)
        bound = self._bound(training)
        if bound is not None and L > bound:
            return False  # past what any layout's memory holds: the full search that fails is skipped
        try:
            plan_one(self.cluster, self.model, training, int(L), self.causal, strategy_of("hexiseq"), FIT_PROBE_S,
                      None)
            return True
        except (MemoryFitError, UnsupportedError):
            return False

    def _bound(self, training):
        """The longest sequence any layout of the kind could hold in memory (None: no limit); see
        memory_tokens_bound."""
        if training not in self._bounds:
            self._bounds[training] = memory_tokens_bound(self.cluster, self.model, training)
        return self._bounds[training]

    def _floor(self):
        return max(4 * self.SHORT, 16 * self.cluster.num_devices)

    def _ensure(self):
        if self.longest is not None:
            return
        self.anchor = self._longest(self.plain, self._floor())
        if self.training.memory_features == "none":
            self.longest = self.anchor
        else:  # from where the plain search ended: the features only lengthen it
            self.longest = max(self.anchor, self._longest(self.training, max(self.anchor, self._floor())))
        if not self.anchor:
            self.anchor = self.longest

    def _longest(self, training, lo):
        """The longest sequence (to 1/256) that fits `training`, searched up from `lo`; 0 when lo does not fit.

        Climbs 4x at a time from `lo` until a length does not fit, then bisects. A probe that fits is cheap (the
        scheduler stops at its first plan that fits); one that does not runs the full search (twice with memory
        features), except past the memory bound (_bound), where _fits answers without planning. Without memory
        features the bound is tight on a node of one GPU model (within 0.3% of the longest), so the length just
        under it is tried first and, when it fits, ends the search. The climb and the bisection keep the probe points
        they always had: whether a length fits was not monotone in the length (the scheduler rounded token shares
        onto devices whose memory binds, and with memory features capped devices as if each used every feature;
        both fixed), and other points then found lengths up to 15% shorter on mixed groups of 64-256 devices. The
        scheduler is a heuristic, so a capacity is a length that fits, not always the longest."""
        if not self._fits(lo, training):
            return 0
        bound = self._bound(training)
        if bound is not None and training.memory_features == "none" and bound - lo > max(1, lo // 256):
            x = bound - max(1, bound // 257)
            if self._fits(x, training):
                return x  # within 1/256 of the bound, which no longer length passes
        hi = lo
        while hi < (1 << 30) and self._fits(hi, training):
            lo, hi = hi, hi * 4
        while hi - lo > max(1, lo // 256):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits(mid, training) else (lo, mid)
        return lo

    def bases(self, scale):
        """The base layouts made for passes of anchor / scale tokens, with their (f, a, b)."""
        if scale not in self._bases:
            S = max(self.anchor // scale, self._floor())
            made = {}

            def one(docs):
                # the features only where nothing fits without (once: without features allowed the two are one)
                for training in (self.plain,) if self.plain == self.training else (self.plain, self.training):
                    try:
                        base = plan_layout(self.cluster, model=self.model, seq_len=S, training=training,
                                    causal=self.causal, strategy="hexiseq", documents=docs)
                        made[docs is None] = (base,) + self._fit(base)
                        return
                    except (MemoryFitError, UnsupportedError):
                        continue

            # the two bases planned side by side: on thousands of devices each is a long search
            run_in_threads(one, [None, _short_docs(S, self.TYPICAL)], self.threads)
            out = [made[k] for k in (True, False) if k in made]
            self._bases[scale] = out
        return self._bases[scale]

    def _fit(self, base):
        """(f, a, b) of a base: least squares over the cost model's figures for the base re-balanced to passes of
        S_ref / 16, S_ref / 4 and S_ref tokens, each as short documents, as one document, and as one document of half
        the tokens beside short ones (nine points), with f, a, b >= 0."""
        S, d = base.seq_len, self.SHORT
        rows, ys = [], []
        for n in {max(S // 16, 4 * d, base.num_groups), max(S // 4, 4 * d, base.num_groups), S}:
            for docs in (_short_docs(n, d), None, [n // 2] + _short_docs(n - n // 2, d)):
                try:
                    t = base.rebalanced(seq_len=n, documents=docs).step_time_s
                except (MemoryFitError, InvalidArgumentError):
                    continue
                pairs = float(visible_pairs(docs if docs is not None else [n], self.causal).sum())
                rows.append((1.0, float(n), pairs))
                ys.append(t)
        A, y = np.array(rows), np.array(ys)
        scale = np.abs(A).max(axis=0)
        scale[scale == 0] = 1.0
        free = [0, 1, 2]
        while True:  # non-negative least squares on three columns: drop a column that comes out negative, refit
            x = np.zeros(3)
            x[free] = np.linalg.lstsq(A[:, free] / scale[free], y, rcond=None)[0] / scale[free]
            neg = [k for k in free if x[k] < 0]
            if not neg:
                break
            free.remove(min(neg, key=lambda k: x[k] * scale[k]))
            if not free:
                x = np.zeros(3)
                break
        return float(x[0]), float(x[1]), float(x[2])

    def _scale(self, expect):
        """Which bases price passes of about `expect` tokens (after _ensure)."""
        want = self.anchor / max(min(expect, self.anchor), 1)
        return min(self.SCALES, key=lambda k: abs(math.log(k) - math.log(want)))

    def priced(self, expect):
        """Whether coefficients(..., expect) plans nothing (its capacity and those bases are made)."""
        return self.longest is not None and (not self.longest or self._scale(expect) in self._bases)

    def coefficients(self, tokens, visible, expect):
        """(a, b, f, base Plan) of a pass, f + a tokens + b visible pairs, under the base made for passes nearest
        `expect` tokens that prices a pass of that share of the batch (`tokens` in all, `visible` pairs) lowest;
        None when the kind holds nothing."""
        self._ensure()
        if not self.longest:
            return None
        scale = self._scale(expect)
        share = min(expect / max(tokens, 1.0), 1.0)  # of the batch, what a group of this kind can expect
        best = None
        for base, f, a, b in self.bases(scale):
            total = (a * tokens + b * visible) * share + f
            if best is None or total < best[0]:
                best = (total, a, b, f, base)
        return None if best is None else best[1:]


def available_cores():
    """The cores this process may run on (its affinity where the platform says, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def run_in_threads(fn, items, threads):
    """fn(item) for every item, on up to `threads` threads, items in the order given (biggest work first is the
    caller's to arrange). For pricing kinds: the core plans without holding the GIL, a kind's searches touch
    nothing but the kind, and each answer is the same whatever runs beside it (no clock decides one), so the kinds
    priced side by side give the plan they give one after another. The first error is raised once every started
    item has ended; the items not started are dropped."""
    if threads <= 1 or len(items) <= 1:
        for x in items:
            fn(x)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def rebalanced_pass(kind, pass_docs):
    """The best of the kind's base layouts re-balanced to one pass's documents (None when none holds them): a few
    cost-model evaluations per base and no search. How a per-step plan resolves its passes; exact_pass also runs
    the scheduler on the pass (on benchmarks/batch_planning.py's clusters, 128 GPUs and 62-512 sequences: 5-40x
    the time, for passes a median 0.1-1.2% faster, one in 59 by 23%)."""
    best = None
    S = sum(pass_docs)
    for scale_bases in kind._bases.values():
        for base, *_ in scale_bases:
            try:
                p = base.rebalanced(seq_len=S, documents=pass_docs if len(pass_docs) > 1 else None)
            except (MemoryFitError, InvalidArgumentError):
                continue
            if best is None or p.step_time_s < best.step_time_s:
                best = p
    return best


def exact_pass(kind, pass_docs):
    """The best plan for one pass's documents on a kind of group (None when none fits): the scheduler's own plan
    for that packed sequence, or one of the kind's base layouts re-balanced to it, whichever the cost model
    scores faster."""
    best = None
    S = sum(pass_docs)
    try:
        best = plan_layout(kind.cluster, model=kind.model, seq_len=S, training=kind.training, causal=kind.causal,
                           strategy="hexiseq", documents=pass_docs if len(pass_docs) > 1 else None)
    except (MemoryFitError, UnsupportedError):
        pass
    rebalanced = rebalanced_pass(kind, pass_docs)
    if rebalanced is not None and (best is None or rebalanced.step_time_s < best.step_time_s):
        best = rebalanced
    return best


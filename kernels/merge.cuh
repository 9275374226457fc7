// The merge kernel (hexiseq_attn_merge_cuda, and the forward's split of long key blocks) and the split forward's
// fill and store kernels.
//
// Merge: one warp per (batch, head, row); lane 0 reads both LSEs, the warp updates the row, lane 0
// writes the new LSE last (so no thread reads an LSE another already rewrote).
// The split forward (forward_typed in forward.cu) merges each piece's fp32 partials into double accumulators with
// the same kernel, then attn_fwd_store_kernel rounds them into o and lse.
#ifndef HEXISEQ_KERNELS_MERGE_CUH
#define HEXISEQ_KERNELS_MERGE_CUH

#include "attention.h"
#include "tile.cuh"

namespace {

// One element of any hexiseq_dtype as double / stored from double (merge only: it mixes dtypes).
__device__ double load_any(const void *base, int32_t dtype, int64_t at) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return ((const double *)base)[at];
    case HEXISEQ_DTYPE_F32: return (double)((const float *)base)[at];
    case HEXISEQ_DTYPE_F16: return (double)__half2float(((const __half *)base)[at]);
    default: return (double)__bfloat162float(((const __nv_bfloat16 *)base)[at]);
    }
}

__device__ void store_any(void *base, int32_t dtype, int64_t at, double x) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: ((double *)base)[at] = x; break;
    case HEXISEQ_DTYPE_F32: ((float *)base)[at] = (float)x; break;
    case HEXISEQ_DTYPE_F16: ((__half *)base)[at] = __float2half_rn((float)x); break; // as the CPU: via float
    default: ((__nv_bfloat16 *)base)[at] = __float2bfloat16_rn((float)x); break;
    }
}

__global__ void attn_merge_kernel(const hexiseq_attn_merge_params m) {
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; // (b * heads + h) * seq + s
    const int lane = threadIdx.x % 32;
    if (row >= m.batch * m.heads * m.seq)
        return;
    const int64_t s = row % m.seq;
    const int64_t h = row / m.seq % m.heads;
    const int64_t b = row / m.seq / m.heads;
    const int64_t la_at = b * m.lse_acc_stride[0] + h * m.lse_acc_stride[1] + s * m.lse_acc_stride[2];
    const int64_t lp_at = b * m.lse_part_stride[0] + h * m.lse_part_stride[1] + s * m.lse_part_stride[2];
    const int64_t oa_at = b * m.o_acc_stride[0] + s * m.o_acc_stride[1] + h * m.o_acc_stride[2];
    const int64_t op_at = b * m.o_part_stride[0] + s * m.o_part_stride[1] + h * m.o_part_stride[2];
    const int32_t la_dt = m.acc_dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32;
    const int32_t lp_dt = m.part_dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32;
    const double la = load_any(m.lse_acc, la_dt, la_at);
    const double lp = load_any(m.lse_part, lp_dt, lp_at);
    if (lp == -INFINITY)
        return; // the partial saw no key: exact no-op
    double wa = 0.0, wp = 1.0, lnew = lp;
    if (la != -INFINITY) { // logaddexp without overflow: the larger term factors out, the weights are <= 1
        const double hi = la > lp ? la : lp;
        lnew = hi + log1p(exp(-fabs(la - lp)));
        wa = exp(la - lnew);
        wp = exp(lp - lnew);
    }
    for (int32_t c = lane; c < m.head_dim; c += 32) {
        const double op = load_any(m.o_part, m.part_dtype, op_at + c * m.o_part_stride[3]);
        // la = -inf: the accumulator row is replaced (never read: it may hold anything, even NaN)
        const double oa = la == -INFINITY ? 0.0 : load_any(m.o_acc, m.acc_dtype, oa_at + c * m.o_acc_stride[3]);
        store_any(m.o_acc, m.acc_dtype, oa_at + c * m.o_acc_stride[3], wa * oa + wp * op);
    }
    __syncwarp(); // every lane read la before lane 0 rewrites it
    if (lane == 0)
        store_any(m.lse_acc, la_dt, la_at, lnew);
}


// x[i] = value for i < n (grid-stride).
__global__ void attn_fill_kernel(double *x, int64_t n, double value) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = value;
}

// The last step of a forward split into key pieces, for one slice of query rows (p: the call's params with o, lse at
// the slice's first row and seq_q its row count): o[b, i, h, c] = acc[b, i, h, c] rounded to p.dtype (acc: double,
// contiguous [batch, seq_q, heads, head_dim]; 0 for a row whose lse_acc is -inf) and lse[b, h, i] = lse_acc (double,
// contiguous [batch, heads, seq_q]), one thread per element of acc.
__global__ void attn_fwd_store_kernel(const hexiseq_attn_params p, const double *acc, const double *lse_acc) {
    const int64_t seq = p.seq_q;
    const int64_t n = p.batch * seq * p.heads * p.head_dim;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % p.head_dim;
        const int64_t h = idx / p.head_dim % p.heads;
        const int64_t i = idx / p.head_dim / p.heads % seq;
        const int64_t b = idx / p.head_dim / p.heads / seq;
        const double lse = lse_acc[(b * p.heads + h) * seq + i];
        // a row no piece saw anything of was never written by the merge: O = 0
        store_any(p.o, p.dtype, b * p.o_stride[0] + i * p.o_stride[1] + h * p.o_stride[2] + c * p.o_stride[3],
                  lse == -INFINITY ? 0.0 : acc[idx]);
        if (c == 0)
            static_cast<float *>(p.lse)[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = (float)lse;
    }
}

} // namespace

#endif // HEXISEQ_KERNELS_MERGE_CUH

// ---------------------------------------------------------------------------------
// Elementwise and reduction kernels.
// ---------------------------------------------------------------------------------

// The end of an MoE layer: hidden[t, i] += combine_sum(...), the sum over k = 0..top_k-1, in that
// order, of weights[t, k] * y[t, k, i] (fused multiply-adds), or of y[t, k, i] where weights is null
// (rows the routing weights already scale), plus extra[t, i] (a shared expert's output) where
// extra is not null. dense_combine_rms_norm (dense.cu) adds the same sums. P, the type of y: a restricted
// pointer, or a volatile one where other blocks of the same launch wrote y (mul_mat_vec_combine_norm).
template <typename P>
__device__ float combine_sum(P y, const float* __restrict__ weights, const float* __restrict__ extra, int t, int i,
                             int top_k, int n) {
    float acc = 0.0f;
#pragma unroll 8  // every pair's element loaded before the sum, which stays in order
    for (int k = 0; k < top_k; ++k) {
        const float v = y[((long long)t * top_k + k) * n + i];
        acc = weights ? fmaf(weights[t * top_k + k], v, acc) : acc + v;
    }
    if (extra) {
        acc += extra[(long long)t * n + i];
    }
    return acc;
}

extern "C" __global__ void moe_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, int n) {
    KERNEL_PROLOGUE();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = silu_times(gate[i], up[i]);
    }
}

// moe_combine: hidden[t, i] += combine_sum(y, weights, extra, t, i, top_k, n).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const float* __restrict__ extra, float* __restrict__ hidden, int n_tokens,
                                       int top_k, int n) {
    KERNEL_PROLOGUE();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        hidden[(long long)t * n + i] += combine_sum<const float* __restrict__>(y, weights, extra, t, i, top_k, n);
    }
}

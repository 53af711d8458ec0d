// ---------------------------------------------------------------------------------
// Stand-ins the prefill runner puts around the MoE block: a weightless RMS norm in
// place of attention and normalization, and the residual add.
// ---------------------------------------------------------------------------------

// x[t, :] = h[t, :] / sqrt(mean(h[t, :]^2) + 1e-6). One block per token; blockDim.x must be
// a power of two and the launch must give blockDim.x floats of dynamic shared memory. The
// reduction runs in a fixed order, so the result never depends on timing.
extern "C" __global__ void moe_rms_norm(const float* __restrict__ h, float* __restrict__ x, int n_tokens, int n) {
    KERNEL_PROLOGUE();
    extern __shared__ float partial[];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;  // the whole block returns: no thread is left waiting at a barrier
    }
    const float* row = h + (long long)t * n;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sum = fmaf(row[i], row[i], sum);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float scale = 1.0f / sqrtf(partial[0] / (float)n + 1e-6f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        x[(long long)t * n + i] = row[i] * scale;
    }
}

// h[i] += delta[i] for i < n.
extern "C" __global__ void moe_add_inplace(float* __restrict__ h, const float* __restrict__ delta, int n) {
    KERNEL_PROLOGUE();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        h[i] += delta[i];
    }
}

// ---------------------------------------------------------------------------------
// qwen3next's recurrent layers and gated attention (part of the kernel source, see program.py;
// launched by kernels/recurrent.py), as llama.cpp's qwen3next graph computes them:
//
// - recur_conv_silu_k*: the causal convolution over the last K inputs of each channel, state
//   first (the K - 1 inputs before the batch), then silu; the state keeps the batch's last K - 1.
// - recur_delta_net_s*: the gated delta rule of one value head per block, its S x S state in the
//   registers of S threads (thread j: row j, the state's part that gives value j), tokens in order:
//   q and k L2-normed (q then over sqrt(S)), S = exp(g) S, d = beta (v - S k), S += d k^T,
//   o = S q; then o over its RMS times the norm weight and silu(z), what ssm_out reads.
// - recur_mul_sigmoid: x *= sigmoid(gate), gated attention's output gate.
//
// A batch whose first position is 0 starts a sequence: its state is taken as zeros (read from
// the device, so a captured step replays right). Every sum runs in a fixed order.
// ---------------------------------------------------------------------------------

__device__ float recur_silu(float x) {
    return x / (1.0f + expf(-x));
}

// out[t, c] = silu(sum_i window[i] * w[c, i]) over the K inputs of channel c up to token t (oldest
// first, the state's K - 1 before token 0); state [K - 1, channels] becomes the batch's last K - 1
// inputs. Thread c of the grid, tokens in order.
template <int K>
__device__ void recur_conv_silu(const float* __restrict__ x, float* __restrict__ state, const float* __restrict__ w,
                                const int* __restrict__ positions, float* __restrict__ out, int n_tokens,
                                int channels) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) {
        return;
    }
    const bool fresh = positions[0] == 0;
    float window[K];
    float taps[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
        taps[i] = w[(long long)c * K + i];
    }
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        window[i] = fresh ? 0.0f : state[(long long)i * channels + c];
    }
    for (int t = 0; t < n_tokens; ++t) {
        window[K - 1] = x[(long long)t * channels + c];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < K; ++i) {
            acc = fmaf(window[i], taps[i], acc);
        }
        out[(long long)t * channels + c] = recur_silu(acc);
#pragma unroll
        for (int i = 0; i < K - 1; ++i) {
            window[i] = window[i + 1];
        }
    }
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        state[(long long)i * channels + c] = window[i];
    }
}

extern "C" __global__ void recur_conv_silu_k4(const float* __restrict__ x, float* __restrict__ state,
                                              const float* __restrict__ w, const int* __restrict__ positions,
                                              float* __restrict__ out, int n_tokens, int channels) {
    KERNEL_PROLOGUE();
    recur_conv_silu<4>(x, state, w, positions, out, n_tokens, channels);
}

// The sum of squares of a[0..S) in index order (every thread computes it alike from shared memory).
template <int S>
__device__ float recur_sum_squares(const float* a) {
    float sum = 0.0f;
#pragma unroll 8
    for (int i = 0; i < S; ++i) {
        sum = fmaf(a[i], a[i], sum);
    }
    return sum;
}

// Value head blockIdx.x of a token batch: conv [n_tokens, 2 * n_k * S + n_v * S] (the convolved q, k
// and v, key head h / (n_v / n_k) serving value head h), ba [n_tokens, 2 * n_v] (per key head: the
// betas' logits of its value heads, then their alphas), dt [n_v] and a [n_v] (negative decay rates),
// z [n_tokens, n_v * S], norm [S], state [n_v, S, S] (value row, key column); out [n_tokens, n_v * S].
template <int S>
__device__ void recur_delta_net(const float* __restrict__ conv, const float* __restrict__ ba,
                                const float* __restrict__ dt, const float* __restrict__ a,
                                const float* __restrict__ z, const float* __restrict__ norm,
                                float* __restrict__ state, const int* __restrict__ positions,
                                float* __restrict__ out, int n_tokens, int n_k, int n_v, float eps) {
    __shared__ float qs[S];
    __shared__ float ks[S];
    __shared__ float os[S];
    const int j = threadIdx.x;
    const int h = blockIdx.x;
    const int group = n_v / n_k;
    const int kh = h / group;
    const int key_dim = n_k * S;
    const int width = 2 * key_dim + n_v * S;
    const bool fresh = positions[0] == 0;
    float* row = state + ((long long)h * S + j) * S;
    float st[S];
#pragma unroll
    for (int i = 0; i < S; ++i) {
        st[i] = fresh ? 0.0f : row[i];
    }
    const float q_scale = 1.0f / sqrtf((float)S);
    for (int t = 0; t < n_tokens; ++t) {
        const float* x = conv + (long long)t * width;
        const float* gates = ba + (long long)t * 2 * n_v + kh * 2 * group;
        qs[j] = x[kh * S + j];
        ks[j] = x[key_dim + kh * S + j];
        const float v = x[2 * key_dim + h * S + j];
        __syncthreads();
        const float q_norm = 1.0f / sqrtf(recur_sum_squares<S>(qs) + eps);
        const float k_norm = 1.0f / sqrtf(recur_sum_squares<S>(ks) + eps);
        const float beta = 1.0f / (1.0f + expf(-gates[h % group]));
        const float biased = gates[group + h % group] + dt[h];
        const float softplus = biased > 20.0f ? biased : logf(1.0f + expf(biased));
        const float decay = expf(softplus * a[h]);
        float sk = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) {
            st[i] *= decay;
            sk = fmaf(st[i], ks[i] * k_norm, sk);
        }
        const float d = (v - sk) * beta;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) {
            st[i] = fmaf(ks[i] * k_norm, d, st[i]);
            o = fmaf(st[i], qs[i] * q_norm * q_scale, o);
        }
        os[j] = o;
        __syncthreads();
        const float scale = 1.0f / sqrtf(recur_sum_squares<S>(os) / (float)S + eps);
        const long long at = (long long)t * n_v * S + h * S + j;
        out[at] = o * scale * norm[j] * recur_silu(z[at]);
        __syncthreads();  // the next token overwrites qs, ks and os
    }
#pragma unroll
    for (int i = 0; i < S; ++i) {
        row[i] = st[i];
    }
}

#define RECUR_DELTA_NET_PARAMS                                                                                 \
    const float *__restrict__ conv, const float *__restrict__ ba, const float *__restrict__ dt,                \
        const float *__restrict__ a, const float *__restrict__ z, const float *__restrict__ norm,               \
        float *__restrict__ state, const int *__restrict__ positions, float *__restrict__ out, int n_tokens, \
        int n_k, int n_v, float eps
#define RECUR_DELTA_NET_ARGS conv, ba, dt, a, z, norm, state, positions, out, n_tokens, n_k, n_v, eps

extern "C" __global__ void __launch_bounds__(32) recur_delta_net_s32(RECUR_DELTA_NET_PARAMS) {
    KERNEL_PROLOGUE();
    recur_delta_net<32>(RECUR_DELTA_NET_ARGS);
}

extern "C" __global__ void __launch_bounds__(64) recur_delta_net_s64(RECUR_DELTA_NET_PARAMS) {
    KERNEL_PROLOGUE();
    recur_delta_net<64>(RECUR_DELTA_NET_ARGS);
}

extern "C" __global__ void __launch_bounds__(128) recur_delta_net_s128(RECUR_DELTA_NET_PARAMS) {
    KERNEL_PROLOGUE();
    recur_delta_net<128>(RECUR_DELTA_NET_ARGS);
}

// x[i] *= sigmoid(gate[i]) for i < n.
extern "C" __global__ void recur_mul_sigmoid(float* __restrict__ x, const float* __restrict__ gate, int n) {
    KERNEL_PROLOGUE();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
    }
}

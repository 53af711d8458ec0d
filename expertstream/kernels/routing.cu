// ---------------------------------------------------------------------------------
// Routing (part of the kernel source, see formats.cu): router_topk, the softmax router of
// MoeKernels.router_topk, then the routing and FFN pieces of the other architectures.
// ---------------------------------------------------------------------------------

// Total order for top-k: a larger logit wins, equal logits go to the lower id, NaN loses
// to any number; an empty candidate (id < 0) never wins.
__device__ bool router_better(float v, int e, float best_v, int best_e) {
    if (e < 0) {
        return false;
    }
    if (best_e < 0) {
        return true;
    }
    const bool v_nan = v != v;
    const bool best_nan = best_v != best_v;
    if (v_nan != best_nan) {
        return best_nan;
    }
    if (v_nan) {
        return e < best_e;
    }
    return v > best_v || (v == best_v && e < best_e);
}

// logits = x @ router^T; ids = the top_k experts by logit; weights = softmax over the
// selected logits. One block handles ROUTER_TOKENS tokens, 32 threads per token.
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) moe_router_topk(
    const float* __restrict__ x, const float* __restrict__ router, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_embd, int n_expert, int top_k) {
    __shared__ float logits[ROUTER_TOKENS][ROUTER_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTER_TOKENS][ROUTER_MAX_EXPERTS];
    __shared__ float x_chunk[ROUTER_TOKENS][33];
    __shared__ float r_chunk[ROUTER_EXPERT_CHUNK][33];
    __shared__ float cand_v[ROUTER_THREADS];
    __shared__ int cand_e[ROUTER_THREADS];
    __shared__ float sel_v[ROUTER_TOKENS][ROUTER_MAX_K];
    __shared__ int sel_e[ROUTER_TOKENS][ROUTER_MAX_K];

    const int tid = threadIdx.x;
    const int group = tid / 32;
    const int lane = tid % 32;
    const int t = blockIdx.x * ROUTER_TOKENS + group;

    for (int e0 = 0; e0 < n_expert; e0 += ROUTER_EXPERT_CHUNK) {
        float acc0 = 0.0f;
        float acc1 = 0.0f;
        for (int k0 = 0; k0 < n_embd; k0 += 32) {
            const bool x_inside = t < n_tokens && k0 + lane < n_embd;
            x_chunk[group][lane] = x_inside ? x[(long long)t * n_embd + k0 + lane] : 0.0f;
            for (int i = tid; i < ROUTER_EXPERT_CHUNK * 32; i += ROUTER_THREADS) {
                const int e = e0 + i / 32;
                const int k = k0 + i % 32;
                const bool r_inside = e < n_expert && k < n_embd;
                r_chunk[i / 32][i % 32] = r_inside ? router[(long long)e * n_embd + k] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 32; ++k) {
                acc0 = fmaf(x_chunk[group][k], r_chunk[lane][k], acc0);
                acc1 = fmaf(x_chunk[group][k], r_chunk[lane + 32][k], acc1);
            }
            __syncthreads();
        }
        if (e0 + lane < n_expert) {
            logits[group][e0 + lane] = acc0;
            taken[group][e0 + lane] = 0;
        }
        if (e0 + lane + 32 < n_expert) {
            logits[group][e0 + lane + 32] = acc1;
            taken[group][e0 + lane + 32] = 0;
        }
    }
    __syncthreads();

    for (int j = 0; j < top_k; ++j) {
        float best_v = 0.0f;
        int best_e = -1;
        for (int e = lane; e < n_expert; e += 32) {
            if (!taken[group][e] && router_better(logits[group][e], e, best_v, best_e)) {
                best_v = logits[group][e];
                best_e = e;
            }
        }
        cand_v[tid] = best_v;
        cand_e[tid] = best_e;
        __syncthreads();
        for (int s = 16; s > 0; s >>= 1) {
            if (lane < s && router_better(cand_v[tid + s], cand_e[tid + s], cand_v[tid], cand_e[tid])) {
                cand_v[tid] = cand_v[tid + s];
                cand_e[tid] = cand_e[tid + s];
            }
            __syncthreads();
        }
        if (lane == 0) {
            sel_v[group][j] = cand_v[tid];
            sel_e[group][j] = cand_e[tid];
            taken[group][cand_e[tid]] = 1;
        }
        __syncthreads();
    }

    if (lane == 0 && t < n_tokens) {
        const float max_v = sel_v[group][0];  // the selection order puts the largest first
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            sum += expf(sel_v[group][j] - max_v);
        }
        for (int j = 0; j < top_k; ++j) {
            ids[(long long)t * top_k + j] = sel_e[group][j];
            weights[(long long)t * top_k + j] = expf(sel_v[group][j] - max_v) / sum;
        }
    }
}

// ---------------------------------------------------------------------------------
// Routing and expert FFN pieces per architecture (see kernels/routing.py): router
// logits with an optional bias, gated top-k selection (softmax, sigmoid or softmax
// after selection; a selection-only bias; group-limited selection; normalization
// and scale of the weights), the clamped SwiGLU of gpt-oss, per-expert output
// biases, and the sigmoid gate of a shared expert.
// ---------------------------------------------------------------------------------

#define GATING_SOFTMAX 1          // llama.cpp's expert_gating_func values
#define GATING_SIGMOID 2
#define GATING_SOFTMAX_WEIGHT 3
#define SELECT_THREADS 128        // one block per token in router_select
#define SELECT_MAX_GROUPS 64
#define LOGITS_TOKENS 8           // logits tile: LOGITS_TOKENS tokens x 32 experts
#define WEIGHTS_SUM_MIN 6.103515625e-5f  // floor of the sum that normalized weights divide by
#define NEG_INFINITY bits_to_float(0xff800000u)

// logits[t, e] = x[t, :] . router[e, :] (+ bias[e] when has_bias), accumulated in k order.
extern "C" __global__ void __launch_bounds__(LOGITS_TOKENS * 32) moe_router_logits(
    const float* __restrict__ x, const float* __restrict__ router, const float* __restrict__ bias,
    float* __restrict__ logits, int n_tokens, int n_embd, int n_expert, int has_bias) {
    __shared__ float x_tile[LOGITS_TOKENS][33];
    __shared__ float r_tile[32][33];
    const int lane = threadIdx.x % 32;
    const int row = threadIdx.x / 32;
    const int e = blockIdx.x * 32 + lane;
    const int t = blockIdx.y * LOGITS_TOKENS + row;
    float acc = 0.0f;
    for (int k0 = 0; k0 < n_embd; k0 += 32) {
        x_tile[row][lane] = (t < n_tokens && k0 + lane < n_embd) ? x[(long long)t * n_embd + k0 + lane] : 0.0f;
        for (int i = threadIdx.x; i < 32 * 32; i += LOGITS_TOKENS * 32) {
            const int re = blockIdx.x * 32 + i / 32;
            const int rk = k0 + i % 32;
            r_tile[i / 32][i % 32] = (re < n_expert && rk < n_embd) ? router[(long long)re * n_embd + rk] : 0.0f;
        }
        __syncthreads();
        const int k_end = min(32, n_embd - k0);
        for (int k = 0; k < k_end; ++k) {
            acc = fmaf(x_tile[row][k], r_tile[lane][k], acc);
        }
        __syncthreads();
    }
    if (t < n_tokens && e < n_expert) {
        logits[(long long)t * n_expert + e] = has_bias ? acc + bias[e] : acc;
    }
}

// Block-wide best (value, id) by router_better; every thread gets the winner.
__device__ void select_block_best(float* cand_v, int* cand_e, float v, int e, float* out_v, int* out_e) {
    const int tid = threadIdx.x;
    cand_v[tid] = v;
    cand_e[tid] = e;
    __syncthreads();
    for (int s = SELECT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s && router_better(cand_v[tid + s], cand_e[tid + s], cand_v[tid], cand_e[tid])) {
            cand_v[tid] = cand_v[tid + s];
            cand_e[tid] = cand_e[tid + s];
        }
        __syncthreads();
    }
    *out_v = cand_v[0];
    *out_e = cand_e[0];
    __syncthreads();
}

// Per token: probs = gating(logits); selection = probs (+ sel_bias); with n_group > 1,
// only the n_group_used groups with the largest sum of their two best selection values
// stay selectable; ids = top_k by selection (descending, ties to the lower id);
// weights = probs[ids], softmaxed for GATING_SOFTMAX_WEIGHT, divided by their sum
// (floored) when norm, times scale. One block of SELECT_THREADS per token.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) moe_router_select(
    const float* __restrict__ logits, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_expert, int top_k, int gating, int has_sel_bias,
    int n_group, int n_group_used, int norm, float scale) {
    __shared__ float probs[ROUTER_MAX_EXPERTS];
    __shared__ float sel[ROUTER_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTER_MAX_EXPERTS];
    __shared__ float group_score[SELECT_MAX_GROUPS];
    __shared__ unsigned char group_kept[SELECT_MAX_GROUPS];
    __shared__ float cand_v[SELECT_THREADS];
    __shared__ int cand_e[SELECT_THREADS];
    __shared__ int chosen[ROUTER_MAX_K];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;  // the whole block returns together
    }
    const int tid = threadIdx.x;
    const float* row = logits + (long long)t * n_expert;

    float local_max = NEG_INFINITY;
    for (int e = tid; e < n_expert; e += SELECT_THREADS) {
        probs[e] = row[e];
        local_max = fmaxf(local_max, row[e]);
        taken[e] = 0;
    }
    if (gating == GATING_SOFTMAX) {
        float max_v;
        int unused;
        select_block_best(cand_v, cand_e, local_max, tid, &max_v, &unused);
        float local_sum = 0.0f;
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = expf(probs[e] - max_v);
            local_sum += probs[e];
        }
        cand_v[tid] = local_sum;
        __syncthreads();
        for (int s = SELECT_THREADS / 2; s > 0; s >>= 1) {
            if (tid < s) {
                cand_v[tid] += cand_v[tid + s];
            }
            __syncthreads();
        }
        const float sum = cand_v[0];
        __syncthreads();
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = probs[e] / sum;
        }
    } else if (gating == GATING_SIGMOID) {
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = 1.0f / (1.0f + expf(-probs[e]));
        }
    }
    __syncthreads();
    for (int e = tid; e < n_expert; e += SELECT_THREADS) {
        sel[e] = has_sel_bias ? probs[e] + sel_bias[e] : probs[e];
    }
    __syncthreads();

    if (n_group > 1) {
        const int per_group = n_expert / n_group;
        if (tid < n_group) {
            float first = NEG_INFINITY;
            float second = NEG_INFINITY;
            for (int e = tid * per_group; e < (tid + 1) * per_group; ++e) {
                if (sel[e] > first) {
                    second = first;
                    first = sel[e];
                } else if (sel[e] > second) {
                    second = sel[e];
                }
            }
            group_score[tid] = first + second;
            group_kept[tid] = 0;
        }
        __syncthreads();
        if (tid == 0) {
            for (int j = 0; j < n_group_used; ++j) {
                int best = -1;
                for (int g = 0; g < n_group; ++g) {
                    if (!group_kept[g] && router_better(group_score[g], g, best < 0 ? 0.0f : group_score[best], best)) {
                        best = g;
                    }
                }
                group_kept[best] = 1;
            }
        }
        __syncthreads();
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            if (!group_kept[e / per_group]) {
                sel[e] = NEG_INFINITY;
            }
        }
        __syncthreads();
    }

    for (int j = 0; j < top_k; ++j) {
        float best_v = 0.0f;
        int best_e = -1;
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            if (!taken[e] && router_better(sel[e], e, best_v, best_e)) {
                best_v = sel[e];
                best_e = e;
            }
        }
        float win_v;
        int win_e;
        select_block_best(cand_v, cand_e, best_v, best_e, &win_v, &win_e);
        if (tid == 0) {
            chosen[j] = win_e;
            taken[win_e] = 1;
        }
        __syncthreads();
    }

    if (tid == 0) {
        float w[ROUTER_MAX_K];
        for (int j = 0; j < top_k; ++j) {
            w[j] = probs[chosen[j]];
        }
        if (gating == GATING_SOFTMAX_WEIGHT) {
            float max_w = w[0];
            for (int j = 1; j < top_k; ++j) {
                max_w = fmaxf(max_w, w[j]);
            }
            float sum = 0.0f;
            for (int j = 0; j < top_k; ++j) {
                w[j] = expf(w[j] - max_w);
                sum += w[j];
            }
            for (int j = 0; j < top_k; ++j) {
                w[j] = w[j] / sum;
            }
        }
        if (norm) {
            float sum = 0.0f;
            for (int j = 0; j < top_k; ++j) {
                sum += w[j];
            }
            sum = fmaxf(sum, WEIGHTS_SUM_MIN);
            for (int j = 0; j < top_k; ++j) {
                w[j] = w[j] / sum;
            }
        }
        for (int j = 0; j < top_k; ++j) {
            ids[(long long)t * top_k + j] = chosen[j];
            weights[(long long)t * top_k + j] = w[j] * scale;
        }
    }
}

// gpt-oss's SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = g / (1 + exp(-alpha g)) * (u + 1).
extern "C" __global__ void moe_swiglu_oai(const float* __restrict__ gate, const float* __restrict__ up,
                                          float* __restrict__ out, int n, float alpha, float limit) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = fminf(gate[i], limit);
        const float u = fminf(fmaxf(up[i], -limit), limit);
        out[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

// y[p, i] += bias[ids[p], i] for every (token, k) pair p; pairs with an id outside
// [0, n_expert) are left as they are (mul_mat_id made them NaN).
extern "C" __global__ void moe_add_expert_bias(float* __restrict__ y, const float* __restrict__ bias,
                                               const int* __restrict__ ids, int n_pairs, int n_out,
                                               int n_expert) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) {
        return;
    }
    for (int p = blockIdx.y; p < n_pairs; p += gridDim.y) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert) {
            y[(long long)p * n_out + i] += bias[(long long)e * n_out + i];
        }
    }
}

// y[t, :] *= sigmoid(x[t, :] . w) for a shared expert's output y [n_tokens, n]. One
// block per token; blockDim.x must be a power of two with that many floats of dynamic
// shared memory.
extern "C" __global__ void moe_shared_gate(const float* __restrict__ x, const float* __restrict__ w,
                                           float* __restrict__ y, int n_tokens, int n_embd, int n) {
    extern __shared__ float partial[];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;
    }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) {
        sum = fmaf(x[(long long)t * n_embd + i], w[i], sum);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float gate = 1.0f / (1.0f + expf(-partial[0]));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        y[(long long)t * n + i] *= gate;
    }
}

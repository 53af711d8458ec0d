// ---------------------------------------------------------------------------------
// Routing (part of the kernel source, see formats.cu): the router's logits and the
// selection of experts from them (MoeKernels.router_topk takes both), and the routing and
// FFN pieces of the architectures (routing.py).
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

// ---------------------------------------------------------------------------------
// Routing and expert FFN pieces per architecture (see kernels/routing.py): router
// logits with an optional bias, gated top-k selection (softmax, sigmoid or softmax
// after selection; a selection-only bias; group-limited selection; normalization
// and scale of the weights), the clamped SwiGLU of gpt-oss, per-expert output
// biases, and the sigmoid gate of a shared expert.
// ---------------------------------------------------------------------------------

// The router's warp paths (shuffles in place of shared memory and barriers): NVIDIA's, and the host
// harness's, which emulates the few warp functions they use (ES_EMULATE_WARPS) to hold them to the
// block path's bytes.
#if defined(__CUDA_ARCH__) || defined(ES_EMULATE_WARPS)
#define ROUTER_WARP_PATHS 1
#endif

#define GATING_SOFTMAX 1          // llama.cpp's expert_gating_func values
#define GATING_SIGMOID 2
#define GATING_SOFTMAX_WEIGHT 3
#define SELECT_THREADS 128        // one block per token in router_select
#define SELECT_MAX_GROUPS 64
#define LOGITS_EXPERTS 4          // router logits: experts per block, one 32-thread wave each
#define LOGITS_TOKENS 8           // and tokens per block
#define LOGITS_THREADS (LOGITS_EXPERTS * 32)
#define LOGITS_DEPTH 4            // router row pieces of 16 bytes a lane loads before summing them (8: no faster)
#define WEIGHTS_SUM_MIN 6.103515625e-5f  // floor of the sum that normalized weights divide by
#define NEG_INFINITY bits_to_float(0xff800000u)

// row[k .. k + 3] into v, zeros past n: 16 bytes at once where ``wide`` (n a multiple of 4, the
// rows 16-byte aligned), else one float at a time.
__device__ void logits_load4(const float* row, int k, int n, bool wide, float* v) {
    if (wide) {
        const vec4 w = *(const vec4*)(row + k);
        v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        return;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        v[q] = k + q < n ? row[k + q] : 0.0f;
    }
}

// logits[t, e] = x[t, :] . router[e, :] (+ bias[e] when has_bias). A block takes LOGITS_EXPERTS
// experts (a logical wave of 32 threads each) by LOGITS_TOKENS tokens; lane l of a wave adds the
// products of elements 4l + 128i .. 4l + 128i + 3 (i ascending), then the wave's 32 sums are
// added in a fixed tree: the order does not depend on the load width or the launch, so decode's
// one token and prefill's many get the same logit for the same row. Each wave reads its expert's
// router row once per LOGITS_TOKENS tokens, 16 bytes at a time where aligned.
__device__ void router_logits_block(const float* __restrict__ x, const float* __restrict__ router,
                                    const float* __restrict__ bias, float* __restrict__ logits, int n_tokens,
                                    int n_embd, int n_expert, int has_bias) {
#if defined(__CUDA_ARCH__)
    float* exchange = 0;
#else
    __shared__ float exchange[LOGITS_THREADS];
#endif
    const int lane = threadIdx.x % 32;
    const int e = blockIdx.x * LOGITS_EXPERTS + threadIdx.x / 32;
    const int t0 = blockIdx.y * LOGITS_TOKENS;
    const int tokens = min(LOGITS_TOKENS, n_tokens - t0);
    float acc[LOGITS_TOKENS];
#pragma unroll
    for (int j = 0; j < LOGITS_TOKENS; ++j) {
        acc[j] = 0.0f;
    }
    if (e < n_expert) {
        const float* r_row = router + (long long)e * n_embd;
        const float* x_rows = x + (long long)t0 * n_embd;
        const bool wide = n_embd % 4 == 0 && ((unsigned long long)router & 15u) == 0 &&
                          ((unsigned long long)x & 15u) == 0;
        // LOGITS_DEPTH of the row's 16-byte pieces loaded a lane before any is summed: a 2048-wide
        // row is 16 of them. Summed in the same ascending order.
        for (int k0 = 4 * lane; k0 < n_embd; k0 += 128 * LOGITS_DEPTH) {
            float r[LOGITS_DEPTH][4];
#pragma unroll
            for (int c = 0; c < LOGITS_DEPTH; ++c) {
                if (k0 + 128 * c < n_embd) {
                    logits_load4(r_row, k0 + 128 * c, n_embd, wide, r[c]);
                }
            }
#pragma unroll
            for (int c = 0; c < LOGITS_DEPTH; ++c) {
                const int k = k0 + 128 * c;
                if (k < n_embd) {
#pragma unroll
                    for (int j = 0; j < LOGITS_TOKENS; ++j) {
                        if (j < tokens) {
                            float a[4];
                            logits_load4(x_rows + (long long)j * n_embd, k, n_embd, wide, a);
#pragma unroll
                            for (int q = 0; q < 4; ++q) {
                                acc[j] = fmaf(a[q], r[c][q], acc[j]);
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < LOGITS_TOKENS; ++j) {
        const float sum = wave32_sum(acc[j], exchange);
        if (lane == 0 && e < n_expert && j < tokens) {
            logits[(long long)(t0 + j) * n_expert + e] = has_bias ? sum + bias[e] : sum;
        }
    }
}

// Before KERNEL_PROLOGUE: the rows of the block's experts asked into L2 (PREFETCH_L2), a 128-byte line
// a lane in turn. The router's weights are no kernel's output, and a prefetch reads nothing.
__device__ void prefetch_router_rows(const float* router, int n_embd, int n_expert) {
    const int e = blockIdx.x * LOGITS_EXPERTS + threadIdx.x / 32;
    if (e < n_expert) {
        for (int k = 32 * (threadIdx.x % 32); k < n_embd; k += 32 * 32) {
            PREFETCH_L2(router + (long long)e * n_embd + k);
        }
    }
}

extern "C" __global__ void __launch_bounds__(LOGITS_THREADS) moe_router_logits(
    const float* __restrict__ x, const float* __restrict__ router, const float* __restrict__ bias,
    float* __restrict__ logits, int n_tokens, int n_embd, int n_expert, int has_bias) {
    prefetch_router_rows(router, n_embd, n_expert);
    KERNEL_PROLOGUE();
    router_logits_block(x, router, bias, logits, n_tokens, n_embd, n_expert, has_bias);
}

#if defined(ROUTER_WARP_PATHS)
// The warp's best (value, id) by router_better, valid at lane 0: lane l + s's candidate against lane
// l's for s = 16, 8, 4, 2, 1.
__device__ void warp_best(float* v, int* e) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const float other_v = __shfl_down_sync(0xffffffffu, *v, s);
        const int other_e = __shfl_down_sync(0xffffffffu, *e, s);
        if (router_better(other_v, other_e, *v, *e)) {
            *v = other_v;
            *e = other_e;
        }
    }
}
#endif

// Block-wide best (value, id) by router_better; every thread gets the winner. router_better is a
// strict total order, so the winner does not depend on the order candidates meet in: on NVIDIA
// each warp finds its best by shuffles and thread 0's reading of the warps' bests ends it (two
// barriers instead of a tree of seven); elsewhere a tree in shared memory.
__device__ void select_block_best(float* cand_v, int* cand_e, float v, int e, float* out_v, int* out_e) {
    const int tid = threadIdx.x;
#if defined(ROUTER_WARP_PATHS)
    warp_best(&v, &e);
    if (tid % 32 == 0) {
        cand_v[tid / 32] = v;
        cand_e[tid / 32] = e;
    }
    __syncthreads();
    v = cand_v[0];
    e = cand_e[0];
    for (int w = 1; w < SELECT_THREADS / 32; ++w) {
        if (router_better(cand_v[w], cand_e[w], v, e)) {
            v = cand_v[w];
            e = cand_e[w];
        }
    }
    *out_v = v;
    *out_e = e;
#else
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
#endif
    __syncthreads();
}

#if defined(ROUTER_WARP_PATHS)
// router_better's order as one integer, a larger key winning: the logit's bits made monotone in the
// high word (NaN 0, below every number; -0 taken as +0, which it equals), the complement of the id in
// the low word (the lower id wins a tie). 0 is the empty or taken candidate, which never wins.
__device__ unsigned long long router_key(float v, int e) {
    unsigned int high = 0u;
    if (v == v) {
        const unsigned int bits = float_to_bits(v == 0.0f ? 0.0f : v);
        high = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    }
    return ((unsigned long long)high << 32) | (0xffffffffu - (unsigned int)e);
}

// The warp's largest key, at every lane: the high words' maximum, then the low words' among the lanes
// that hold it (one instruction each from sm_80), else five shuffled comparisons.
__device__ unsigned long long warp_max_key(unsigned long long key) {
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800) || defined(ES_EMULATE_REDUX)
    const unsigned int high = __reduce_max_sync(0xffffffffu, (unsigned int)(key >> 32));
    const unsigned int low = __reduce_max_sync(0xffffffffu, (unsigned int)(key >> 32) == high ? (unsigned int)key : 0u);
    return ((unsigned long long)high << 32) | low;
#else
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, s);
        key = other > key ? other : key;
    }
    return key;
#endif
}

// Token t's top_k experts and weights from one warp: lane l holds the selection values and the
// probabilities of experts l, l + 32, ... (PER of them). Each round takes the largest router_key
// (router_better's winner) and clears it; lane j keeps round j's expert and probability. The weights
// then take thread 0's float operations of the block path below, every sum in ascending j, so both
// paths write the same bytes.
template <int PER>
__device__ __forceinline__ void warp_topk_write(const float* sel, const float* probs, int* __restrict__ ids,
                                                float* __restrict__ weights, int t, int n_expert, int top_k,
                                                int gating, int norm, float scale) {
    const int lane = threadIdx.x % 32;
    unsigned long long key[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < n_expert ? router_key(sel[i], e) : 0ull;
    }
    int my_id = 0;
    float my_w = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        // Each lane's best and its probability, compared by value only: an index chosen at run time
        // would put the arrays in local memory.
        unsigned long long best = 0ull;
        float best_p = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (key[i] > best) {
                best = key[i];
                best_p = probs[i];
            }
        }
        const unsigned long long win_key = warp_max_key(best);
        const int win = (int)(0xffffffffu - (unsigned int)win_key);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            key[i] = key[i] == win_key ? 0ull : key[i];  // keys are unique: only the winner's is cleared
        }
        const float p = __shfl_sync(0xffffffffu, best_p, win % 32);
        if (lane == j) {
            my_id = win;
            my_w = p;
        }
    }
    if (gating == GATING_SOFTMAX_WEIGHT) {
        float max_w = __shfl_sync(0xffffffffu, my_w, 0);
        for (int j = 1; j < top_k; ++j) {
            max_w = fmaxf(max_w, __shfl_sync(0xffffffffu, my_w, j));
        }
        my_w = expf(my_w - max_w);
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            sum += __shfl_sync(0xffffffffu, my_w, j);
        }
        my_w = my_w / sum;
    }
    if (norm) {
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            sum += __shfl_sync(0xffffffffu, my_w, j);
        }
        my_w = my_w / fmaxf(sum, WEIGHTS_SUM_MIN);
    }
    if (lane < top_k) {
        ids[(long long)t * top_k + lane] = my_id;
        weights[(long long)t * top_k + lane] = my_w * scale;
    }
}

// Token t's selection by the first warp alone; lane l holds experts l, l + 32, ... (PER of them) in
// registers. Without groups (sel_all null) from the logits in `row`: the softmax's maximum by shuffles
// and its sum in the block path's order (thread m of SELECT_THREADS adds experts m, m + SELECT_THREADS,
// ... ascending, then a tree of halves: lane l plays threads l, l + 32, l + 64 and l + 96), with no
// barrier and no shared memory. With groups, from the block path's probabilities and selection values
// in shared memory (probs_all, sel_all). Then warp_topk_write: the same bytes as the block path.
template <int PER>
__device__ __forceinline__ void router_select_warp(const volatile float* row, const float* probs_all,
                                                   const float* sel_all, const float* __restrict__ sel_bias,
                                                   int* __restrict__ ids, float* __restrict__ weights, int t,
                                                   int n_expert, int top_k, int gating, int has_sel_bias, int norm,
                                                   float scale) {
    static_assert(SELECT_THREADS == 128, "lane l plays the block path's threads l + 32 m, m < 4");
    const int lane = threadIdx.x % 32;
    float probs[PER];
    float sel[PER];
    if (sel_all) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = lane + 32 * i;
            probs[i] = e < n_expert ? probs_all[e] : 0.0f;
            sel[i] = e < n_expert ? sel_all[e] : 0.0f;
        }
        warp_topk_write<PER>(sel, probs, ids, weights, t, n_expert, top_k, gating, norm, scale);
        return;
    }
    float local_max = NEG_INFINITY;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        probs[i] = e < n_expert ? row[e] : 0.0f;
        if (e < n_expert) {
            local_max = fmaxf(local_max, probs[i]);
        }
    }
    if (gating == GATING_SOFTMAX) {
        float max_v = local_max;
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            max_v = fmaxf(max_v, __shfl_xor_sync(0xffffffffu, max_v, s));
        }
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (lane + 32 * i < n_expert) {
                probs[i] = expf(probs[i] - max_v);
                part[i % 4] += probs[i];
            }
        }
        float sum = (part[0] + part[2]) + (part[1] + part[3]);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            sum += __shfl_down_sync(0xffffffffu, sum, s);
        }
        sum = __shfl_sync(0xffffffffu, sum, 0);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            probs[i] = probs[i] / sum;
        }
    } else if (gating == GATING_SIGMOID) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            probs[i] = 1.0f / (1.0f + expf(-probs[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        sel[i] = has_sel_bias && e < n_expert ? probs[i] + sel_bias[e] : probs[i];
    }
    warp_topk_write<PER>(sel, probs, ids, weights, t, n_expert, top_k, gating, norm, scale);
}

// router_select_warp with PER the fewest experts a lane, of 1, 2, 4, 8 and 16, that cover n_expert (at
// most ROUTER_MAX_EXPERTS).
static_assert(ROUTER_MAX_EXPERTS == 16 * 32, "16 experts a lane cover ROUTER_MAX_EXPERTS");
__device__ void router_select_warp_any(const volatile float* row, const float* probs_all, const float* sel_all,
                                       const float* __restrict__ sel_bias, int* __restrict__ ids,
                                       float* __restrict__ weights, int t, int n_expert, int top_k, int gating,
                                       int has_sel_bias, int norm, float scale) {
#define ROUTER_SELECT_WARP(PER)                                                                              \
    router_select_warp<PER>(row, probs_all, sel_all, sel_bias, ids, weights, t, n_expert, top_k, gating,     \
                            has_sel_bias, norm, scale)
    if (n_expert <= 32) {
        ROUTER_SELECT_WARP(1);
    } else if (n_expert <= 64) {
        ROUTER_SELECT_WARP(2);
    } else if (n_expert <= 128) {
        ROUTER_SELECT_WARP(4);
    } else if (n_expert <= 256) {
        ROUTER_SELECT_WARP(8);
    } else {
        ROUTER_SELECT_WARP(16);
    }
#undef ROUTER_SELECT_WARP
}
#endif

// Token t's experts and weights from its logits, by a block of SELECT_THREADS threads. The logits are
// read as volatile: in moe_router_logits_select other blocks of the same launch wrote them. On NVIDIA
// the first warp alone takes a selection without groups (router_select_warp), and the rounds of a
// grouped one (warp_topk_write); the bytes are the block path's.
__device__ void router_select_row(const volatile float* logits, const float* __restrict__ sel_bias,
                                  int* __restrict__ ids, float* __restrict__ weights, int t, int n_expert, int top_k,
                                  int gating, int has_sel_bias, int n_group, int n_group_used, int norm,
                                  float scale) {
    __shared__ float probs[ROUTER_MAX_EXPERTS];
    __shared__ float sel[ROUTER_MAX_EXPERTS];
#if !defined(ROUTER_WARP_PATHS)
    __shared__ unsigned char taken[ROUTER_MAX_EXPERTS];  // the block-wide rounds' (NVIDIA's keep bits in registers)
    __shared__ int chosen[ROUTER_MAX_K];
#endif
    __shared__ float group_score[SELECT_MAX_GROUPS];
    __shared__ unsigned char group_kept[SELECT_MAX_GROUPS];
    __shared__ float cand_v[SELECT_THREADS];
    __shared__ int cand_e[SELECT_THREADS];
    const int tid = threadIdx.x;
    const volatile float* row = logits + (long long)t * n_expert;
#if defined(ROUTER_WARP_PATHS)
    if (n_group <= 1) {
        if (tid < 32) {
            router_select_warp_any(row, 0, 0, sel_bias, ids, weights, t, n_expert, top_k, gating, has_sel_bias, norm,
                                   scale);
        }
        return;  // no shared memory used: a next row needs no barrier
    }
#endif

    float local_max = NEG_INFINITY;
    for (int e = tid; e < n_expert; e += SELECT_THREADS) {
        const float logit = row[e];
        probs[e] = logit;
        local_max = fmaxf(local_max, logit);
#if !defined(ROUTER_WARP_PATHS)
        taken[e] = 0;
#endif
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

#if defined(ROUTER_WARP_PATHS)
    if (tid < 32) {
        router_select_warp_any(row, probs, sel, sel_bias, ids, weights, t, n_expert, top_k, gating, has_sel_bias,
                               norm, scale);
    }
#else
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
#endif
    __syncthreads();  // probs and sel are read: a next row may overwrite them
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) moe_router_select(
    const float* __restrict__ logits, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_expert, int top_k, int gating, int has_sel_bias,
    int n_group, int n_group_used, int norm, float scale) {
    KERNEL_PROLOGUE();
    if ((int)blockIdx.x >= n_tokens) {
        return;  // the whole block returns together
    }
    router_select_row(logits, sel_bias, ids, weights, blockIdx.x, n_expert, top_k, gating, has_sel_bias, n_group,
                      n_group_used, norm, scale);
}

// moe_router_logits then moe_router_select in one launch, for a few tokens (decode): each block writes
// its logits as moe_router_logits does, then counts itself done in *counter (atomicInc, which wraps the
// last count back to 0 for the next launch; it must hold 0 before the first); the last block to count,
// once every block's logits are visible, selects every token's experts as moe_router_select's blocks
// do, one token after another. The bytes of the two launches.
static_assert(LOGITS_THREADS == SELECT_THREADS, "the last block of moe_router_logits_select selects");
extern "C" __global__ void __launch_bounds__(LOGITS_THREADS) moe_router_logits_select(
    const float* __restrict__ x, const float* __restrict__ router, const float* __restrict__ bias,
    float* logits, unsigned int* counter, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_embd, int n_expert, int has_bias, int top_k, int gating,
    int has_sel_bias, int n_group, int n_group_used, int norm, float scale) {
    prefetch_router_rows(router, n_embd, n_expert);
    KERNEL_PROLOGUE();
    __shared__ int last;
    router_logits_block(x, router, bias, logits, n_tokens, n_embd, n_expert, has_bias);
    __threadfence();  // this thread's logits are visible to every block before the block counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int blocks = gridDim.x * gridDim.y;
        last = atomicInc(counter, blocks - 1) == blocks - 1;
    }
    __syncthreads();
    if (!last) {
        return;  // the whole block returns together
    }
    __threadfence();
    for (int t = 0; t < n_tokens; ++t) {
        router_select_row(logits, sel_bias, ids, weights, t, n_expert, top_k, gating, has_sel_bias, n_group,
                          n_group_used, norm, scale);
    }
}

// gpt-oss's SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = g / (1 + exp(-alpha g)) * (u + 1).
extern "C" __global__ void moe_swiglu_oai(const float* __restrict__ gate, const float* __restrict__ up,
                                          float* __restrict__ out, int n, float alpha, float limit) {
    KERNEL_PROLOGUE();
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
    KERNEL_PROLOGUE();
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
    KERNEL_PROLOGUE();
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

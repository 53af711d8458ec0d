// ---------------------------------------------------------------------------------
// Causal attention over an f16 KV cache (part of the kernel source, see formats.cu; launched by
// kernels/attention.py): out[i, h] = softmax_j(scale q[i, h] . k[j, g]) v[j, g] for the cache rows
// j query i sees (j <= its position, and within the window where one is set), with GQA
// (g = h / (n_head / n_head_kv)) and gpt-oss's per-head sink logits in the denominator.
//
// Every kernel walks the cache in tiles of keys staged in shared memory with an online softmax
// (running max m, running sum l, output o rescaled when m grows), so no score matrix larger than
// one tile ever exists. A block first takes the union of the rows its queries see and stages only
// those rows (others are zeros, never read), so cache rows no query of the launch sees may hold
// anything, NaN included, and tiles outside that union are skipped.
//
// - attn_prefill_simt_d*: one block per (32 queries, head), float32 FMAs: any device.
// - attn_prefill_mma_d*: one block per (64 queries, head), Q.K^T and P.V on f16 matrix
//   instructions with float32 accumulation (the launcher picks it where
//   Capabilities.matrix_cores is set). Q is scaled, then rounded to f16; P is rounded to f16 for
//   P.V while l sums the unrounded values. NVIDIA sm_80+ runs its own kernel on mma.sync m16n8k16
//   fragments (its scores in base 2: Q carries log2(e), so each weight is one ex2 of a difference;
//   tiles every query of a warp sees whole skip the mask; attn_prefill_mma128_d* gives a block 8
//   warps of 16 queries, the same bytes, and is the default for heads 128 wide); every other target
//   runs one written on mma.cu's matrix-step interface
//   (v_mfma_f32_16x16x16f16 on AMD CDNA, v_wmma_f32_16x16x16_f16 on RDNA3/RDNA4, and the
//   interface's generic FMA step elsewhere, so the source compiles and runs on every target).
// - attn_wide_d*: heads too wide for the kernels above (qwen3next's 256, deepseek2's 576), any number
//   of tokens.
// - attn_decode_d* + attn_decode_combine: split-K (flash-decoding) for a few tokens: one block per
//   (chunk of ATTN_DECODE_CHUNK keys, KV head, 8 (token, head) rows) writes each row's m, l and
//   partial o; blocks whose chunk no row sees return at once. The combine kernel then merges a
//   row's chunks in ascending order.
//
// Every reduction runs in a fixed order (quad shuffles on NVIDIA are a fixed tree), so results
// never depend on timing. A chunk's or tile's size never depends on kv_len, so a launch with a
// larger kv_len (a captured decode step) gives the same bytes as one with just enough rows.

// Must match expertstream/kernels/attention.py.
#define ATTN_THREADS 128
#define ATTN_KEYS 32             // keys per staged tile
#define ATTN_PREFILL_ROWS 32     // queries per block of the SIMT prefill
#define ATTN_MMA_ROWS 64         // queries per block of the matrix-core prefill: 16 per warp
#define ATTN_DECODE_ROWS 8       // (token, head) rows per decode block
#define ATTN_DECODE_CHUNK 32     // keys per decode block (one tile: 64 ran slower on an H100, decode-round5.md)

#define ATTN_NEG_INF bits_to_float(0xff800000u)

static_assert(ATTN_DECODE_CHUNK % ATTN_KEYS == 0, "decode chunks hold whole tiles");

struct alignas(16) attn_words4 {
    unsigned int x, y, z, w;
};
struct alignas(8) attn_float2 {
    float x, y;
};
struct alignas(16) attn_float4 {
    float x, y, z, w;
};

// The cache rows [*lo, *hi] query t sees (empty when *lo > *hi; always empty for t outside
// [0, n_tokens)): rows up to its position, at most kv_len - 1, and with a window only the last
// `window` of them.
__device__ void attn_visible(const int* positions, int t, int n_tokens, int kv_len, int window, int* lo, int* hi) {
    if (t < 0 || t >= n_tokens) {
        *lo = 1;
        *hi = 0;
        return;
    }
    const int pos = positions[t];
    *hi = min(pos, kv_len - 1);
    *lo = window > 0 && pos >= window ? pos - window + 1 : 0;  // no overflow for any int position
}

// The low and high f16 of a 32-bit word as floats (exact).
__device__ float attn_half_low(unsigned int w) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w & 0xffffu)));
    return f;
#else
    return half_to_float(w & 0xffffu);
#endif
}

__device__ float attn_half_high(unsigned int w) {
    return attn_half_low(w >> 16);
}

// The 16-byte part `part` of cache row j of KV head g, from the key and the value cache, or zeros
// where j is outside [first, last] (nothing read).
template <int D>
__device__ void attn_cache_part(const unsigned short* k_cache, const unsigned short* v_cache, int n_head_kv, int g,
                                int j, int part, int first, int last, attn_words4* kw, attn_words4* vw) {
    *kw = attn_words4{0u, 0u, 0u, 0u};
    *vw = *kw;
    if (j >= first && j <= last) {
        const long long at = ((long long)j * n_head_kv + g) * D + 8 * part;
        *kw = *(const attn_words4*)(k_cache + at);
        *vw = *(const attn_words4*)(v_cache + at);
    }
}

// The union [*first, *last] of the visible ranges [lo[i], hi[i]] of n rows, clipped to [key_begin, key_end)
// (empty: *first > *last).
__device__ void attn_union(const int* lo, const int* hi, int n, int key_begin, int key_end, int* first, int* last) {
    *first = key_end;
    *last = key_begin - 1;
    for (int i = 0; i < n; ++i) {
        if (lo[i] <= hi[i]) {
            *first = min(*first, max(lo[i], key_begin));
            *last = max(*last, min(hi[i], key_end - 1));
        }
    }
}

// q_row . k_row over D values: float32 queries against a staged f16 key row (D / 2 words), in order.
template <int D>
__device__ float attn_dot_staged(const float* q_row, const unsigned int* k_row) {
    float acc = 0.0f;
#pragma unroll 8
    for (int w = 0; w < D / 2; ++w) {
        const unsigned int kw = k_row[w];
        acc = fmaf(q_row[2 * w], attn_half_low(kw), acc);
        acc = fmaf(q_row[2 * w + 1], attn_half_high(kw), acc);
    }
    return acc;
}

// A row's softmax state after its keys, with the sink logit (if any) joined: out = o / l, or 0
// where nothing was seen (l == 0).
__device__ float attn_join_sink(float m, float* l, float sink) {
    const float top = fmaxf(m, sink);
    const float keep = m == ATTN_NEG_INF ? 0.0f : expf(m - top);
    *l = *l * keep + expf(sink - top);
    return keep;  // what o is multiplied by
}

// ---------------------------------------------------------------------------------
// The SIMT core: ROWS query rows of one KV head against staged tiles of ATTN_KEYS keys.
// Row r is served by the TPR threads r * TPR .. + TPR - 1; thread c of a row computes scores
// c, c + TPR, .. of each tile and owns output pairs (f16 words of a value row) c, c + TPR, ..
// Every thread of a row computes the row's max and sum over the whole tile itself, in key order,
// so they all hold the same m and l without exchanging them.
// ---------------------------------------------------------------------------------

template <int D, int ROWS> struct AttnSimt {
    static const int TPR = ATTN_THREADS / ROWS;
    static const int SCORES = ATTN_KEYS / TPR;
    static const int WORDS = D / 2 / TPR;
    static const int Q_LD = D + 1;      // floats per query row: the rows a warp reads at once hit distinct banks
    static const int K_LD = D / 2 + 1;  // words per key row: odd, for the same reason
    static const int V_LD = D / 2;      // a warp's threads read consecutive words of one value row
    static const int S_LD = ATTN_KEYS + 1;
    static_assert(ATTN_THREADS % ROWS == 0 && ATTN_KEYS % TPR == 0 && (D / 2) % TPR == 0, "even split");

    struct Shared {
        float q[ROWS * Q_LD];
        unsigned int k[ATTN_KEYS * K_LD];
        unsigned int v[ATTN_KEYS * V_LD];
        float s[ROWS * S_LD];
        int lo[ROWS];
        int hi[ROWS];
    };

    struct Row {
        float m;
        float l;
        float o[2 * WORDS];
    };
};

// Stage query row r (token t of head h, zeros where t < 0) and its visible range.
template <int D, int ROWS>
__device__ void attn_simt_load_rows(typename AttnSimt<D, ROWS>::Shared& sh, const float* q, const int* positions,
                                    int n_tokens, int kv_len, int window, int n_head, const int* row_token,
                                    const int* row_head) {
    typedef AttnSimt<D, ROWS> A;
    const int tid = threadIdx.x;
    if (tid < ROWS) {
        attn_visible(positions, row_token[tid], n_tokens, kv_len, window, &sh.lo[tid], &sh.hi[tid]);
    }
    for (int i = tid; i < ROWS * D; i += ATTN_THREADS) {
        const int r = i / D;
        const int t = row_token[r];
        sh.q[r * A::Q_LD + i % D] = t >= 0 ? q[((long long)t * n_head + row_head[r]) * D + i % D] : 0.0f;
    }
    __syncthreads();
}

// The rows' attention over cache rows [key_begin, key_end) of KV head g; rows and ranges staged by
// attn_simt_load_rows. Leaves this thread's row state in st.
template <int D, int ROWS>
__device__ void attn_simt_rows(typename AttnSimt<D, ROWS>::Shared& sh, const unsigned short* k_cache,
                               const unsigned short* v_cache, int n_head_kv, int g, int key_begin, int key_end,
                               float scale, typename AttnSimt<D, ROWS>::Row& st) {
    typedef AttnSimt<D, ROWS> A;
    const int tid = threadIdx.x;
    const int r = tid / A::TPR;
    const int c = tid % A::TPR;
    st.m = ATTN_NEG_INF;
    st.l = 0.0f;
#pragma unroll
    for (int i = 0; i < 2 * A::WORDS; ++i) {
        st.o[i] = 0.0f;
    }
    int first, last;
    attn_union(sh.lo, sh.hi, ROWS, key_begin, key_end, &first, &last);
    const int row_lo = sh.lo[r];
    const int row_hi = sh.hi[r];
    const float* q_row = sh.q + r * A::Q_LD;
    const int PARTS = D / 8;  // 16-byte parts of a cache row
    for (int j0 = first - first % ATTN_KEYS; j0 <= last; j0 += ATTN_KEYS) {
        for (int i = tid; i < ATTN_KEYS * PARTS; i += ATTN_THREADS) {
            const int jr = i / PARTS;
            const int part = i % PARTS;
            attn_words4 kw, vw;
            attn_cache_part<D>(k_cache, v_cache, n_head_kv, g, j0 + jr, part, first, last, &kw, &vw);
            unsigned int* k_to = sh.k + jr * A::K_LD + 4 * part;
            unsigned int* v_to = sh.v + jr * A::V_LD + 4 * part;
            k_to[0] = kw.x;
            k_to[1] = kw.y;
            k_to[2] = kw.z;
            k_to[3] = kw.w;
            v_to[0] = vw.x;
            v_to[1] = vw.y;
            v_to[2] = vw.z;
            v_to[3] = vw.w;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < A::SCORES; ++u) {
            const int jr = c + A::TPR * u;
            const float acc = attn_dot_staged<D>(q_row, sh.k + jr * A::K_LD);
            const int j = j0 + jr;
            sh.s[r * A::S_LD + jr] = j >= row_lo && j <= row_hi ? acc * scale : ATTN_NEG_INF;
        }
        __syncthreads();
        const float* s_row = sh.s + r * A::S_LD;
        float tile_max = ATTN_NEG_INF;
        for (int jr = 0; jr < ATTN_KEYS; ++jr) {
            tile_max = fmaxf(tile_max, s_row[jr]);
        }
        const float m_new = fmaxf(st.m, tile_max);
        const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;  // a row that saw nothing stays at zeros
        const float alpha = expf(st.m - m_use);
        st.m = m_new;
        st.l *= alpha;
#pragma unroll
        for (int i = 0; i < 2 * A::WORDS; ++i) {
            st.o[i] *= alpha;
        }
        for (int jr = 0; jr < ATTN_KEYS; ++jr) {
            const float p = expf(s_row[jr] - m_use);
            st.l += p;
            const unsigned int* v_row = sh.v + jr * A::V_LD + c;
#pragma unroll
            for (int u = 0; u < A::WORDS; ++u) {
                const unsigned int vw = v_row[A::TPR * u];
                st.o[2 * u] = fmaf(p, attn_half_low(vw), st.o[2 * u]);
                st.o[2 * u + 1] = fmaf(p, attn_half_high(vw), st.o[2 * u + 1]);
            }
        }
        __syncthreads();  // the next tile overwrites k, v and s
    }
}

#define ATTN_PREFILL_PARAMS                                                                                  \
    const float *__restrict__ q, const unsigned short *__restrict__ k_cache,                                 \
        const unsigned short *__restrict__ v_cache, float *__restrict__ out, const int *__restrict__ positions, \
        const float *__restrict__ sinks, int n_tokens, int kv_len, int n_head, int n_head_kv, int window,    \
        float scale
#define ATTN_PREFILL_ARGS q, k_cache, v_cache, out, positions, sinks, n_tokens, kv_len, n_head, n_head_kv, window, scale

// Queries first_token .. + ATTN_PREFILL_ROWS - 1 of head blockIdx.y, written to out.
template <int D>
__device__ void attn_prefill_simt_rows(ATTN_PREFILL_PARAMS, int first_token) {
    typedef AttnSimt<D, ATTN_PREFILL_ROWS> A;
    __shared__ typename A::Shared sh;
    __shared__ int row_token[ATTN_PREFILL_ROWS];
    __shared__ int row_head[ATTN_PREFILL_ROWS];
    const int head = blockIdx.y;
    const int tid = threadIdx.x;
    if (tid < ATTN_PREFILL_ROWS) {
        row_token[tid] = first_token + tid < n_tokens ? first_token + tid : -1;
        row_head[tid] = head;
    }
    __syncthreads();
    attn_simt_load_rows<D, ATTN_PREFILL_ROWS>(sh, q, positions, n_tokens, kv_len, window, n_head, row_token,
                                              row_head);
    typename A::Row st;
    attn_simt_rows<D, ATTN_PREFILL_ROWS>(sh, k_cache, v_cache, n_head_kv, head / (n_head / n_head_kv), 0, kv_len,
                                         scale, st);
    const int t = first_token + tid / A::TPR;
    if (t >= n_tokens) {
        return;
    }
    const float keep = sinks ? attn_join_sink(st.m, &st.l, sinks[head]) : 1.0f;
    const float inv = st.l > 0.0f ? keep / st.l : 0.0f;
    float* out_row = out + ((long long)t * n_head + head) * D;
#pragma unroll
    for (int u = 0; u < A::WORDS; ++u) {
        const int w = tid % A::TPR + A::TPR * u;
        *(attn_float2*)(out_row + 2 * w) = attn_float2{st.o[2 * u] * inv, st.o[2 * u + 1] * inv};
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prefill_simt_d64(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_prefill_simt_rows<64>(ATTN_PREFILL_ARGS, blockIdx.x * ATTN_PREFILL_ROWS);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prefill_simt_d128(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_prefill_simt_rows<128>(ATTN_PREFILL_ARGS, blockIdx.x * ATTN_PREFILL_ROWS);
}

// ---------------------------------------------------------------------------------
// Split-K decode. Block (chunk, g, z) serves rows z * ATTN_DECODE_ROWS .. of KV head g's
// n_tokens x group (token, head) rows over keys [chunk * ATTN_DECODE_CHUNK, + ATTN_DECODE_CHUNK),
// and writes each row's m, l (partial_ml) and unnormalized o (partial_o) at index
// (token * n_head + head) * n_chunks + chunk. The combine kernel reads, for each row, only the
// chunks its visible range touches; every block serving such a chunk runs and writes it.
// ---------------------------------------------------------------------------------

template <int D>
__device__ void attn_decode_chunk(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                                  const unsigned short* __restrict__ v_cache, float* __restrict__ partial_ml,
                                  float* __restrict__ partial_o, const int* __restrict__ positions, int n_tokens,
                                  int kv_len, int n_head, int n_head_kv, int window, float scale, int n_chunks) {
    typedef AttnSimt<D, ATTN_DECODE_ROWS> A;
    __shared__ typename A::Shared sh;
    __shared__ int row_token[ATTN_DECODE_ROWS];
    __shared__ int row_head[ATTN_DECODE_ROWS];
    const int tid = threadIdx.x;
    const int chunk = blockIdx.x;
    const int g = blockIdx.y;
    const int group = n_head / n_head_kv;
    const int key_begin = chunk * ATTN_DECODE_CHUNK;
    const int key_end = key_begin + ATTN_DECODE_CHUNK;
    // Every thread decides alike whether any row sees this chunk, so the block returns as one.
    bool seen = false;
    for (int r = 0; r < ATTN_DECODE_ROWS; ++r) {
        const int row = blockIdx.z * ATTN_DECODE_ROWS + r;
        int lo, hi;
        attn_visible(positions, row / group, n_tokens, kv_len, window, &lo, &hi);
        seen = seen || (lo <= hi && lo < key_end && hi >= key_begin);
    }
    if (!seen) {
        return;
    }
    if (tid < ATTN_DECODE_ROWS) {
        const int row = blockIdx.z * ATTN_DECODE_ROWS + tid;
        row_token[tid] = row / group < n_tokens ? row / group : -1;
        row_head[tid] = g * group + row % group;
    }
    __syncthreads();
    attn_simt_load_rows<D, ATTN_DECODE_ROWS>(sh, q, positions, n_tokens, kv_len, window, n_head, row_token,
                                             row_head);
    typename A::Row st;
    attn_simt_rows<D, ATTN_DECODE_ROWS>(sh, k_cache, v_cache, n_head_kv, g, key_begin, key_end, scale, st);
    const int r = tid / A::TPR;
    const int c = tid % A::TPR;
    if (row_token[r] < 0) {
        return;
    }
    const long long at = ((long long)row_token[r] * n_head + row_head[r]) * n_chunks + chunk;
    if (c == 0) {
        partial_ml[2 * at] = st.m;
        partial_ml[2 * at + 1] = st.l;
    }
    float* o_row = partial_o + at * D;
#pragma unroll
    for (int u = 0; u < A::WORDS; ++u) {
        const int w = c + A::TPR * u;
        *(attn_float2*)(o_row + 2 * w) = attn_float2{st.o[2 * u], st.o[2 * u + 1]};
    }
}

#define ATTN_DECODE_PARAMS                                                                                    \
    const float *__restrict__ q, const unsigned short *__restrict__ k_cache,                                  \
        const unsigned short *__restrict__ v_cache, float *__restrict__ partial_ml, float *__restrict__ partial_o, \
        const int *__restrict__ positions, int n_tokens, int kv_len, int n_head, int n_head_kv, int window,   \
        float scale, int n_chunks
#define ATTN_DECODE_ARGS \
    q, k_cache, v_cache, partial_ml, partial_o, positions, n_tokens, kv_len, n_head, n_head_kv, window, scale, n_chunks

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_d64(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_decode_chunk<64>(ATTN_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_d128(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_decode_chunk<128>(ATTN_DECODE_ARGS);
}

// out[t, h, :] from the chunks of row (t, h) that its visible range touches, by the whole block: (strand s,
// d) for s < ATTN_COMBINE_STRANDS adds the row's chunks s, s + ATTN_COMBINE_STRANDS, ... in ascending order
// for its d (each thread takes every blockDim.x-th (s, d)); the strands' maxima meet first (a max is exact
// in any order), then their sums in strand order. So the bytes do not depend on the block size. At 32768
// keys a row has 512 chunks: one strand of them was a chain of 1024 dependent loads per thread, in a launch
// of only n_head blocks for a token. P is how the partials are read: const float* __restrict__ in
// attn_decode_combine, const volatile float* in attn_decode_fused_d*, where other blocks of the same
// launch wrote them (no read-only cache path, no load the compiler may reuse). MAX_D: the widest head its
// strands hold (the fused kernels' own D).
#define ATTN_COMBINE_STRANDS 4
#define ATTN_COMBINE_MAX_D 576  // head_dim at most (the wide decode kernels' widest)
template <typename P, int MAX_D>
__device__ void attn_combine_row(P partial_ml, P partial_o, const int* __restrict__ positions,
                                 const float* __restrict__ sinks,
                                 float* __restrict__ out, int t, int h, int n_tokens, int kv_len, int n_head,
                                 int window, int n_chunks, int head_dim) {
    __shared__ float strand_top[ATTN_COMBINE_STRANDS];
    __shared__ float strand_l[ATTN_COMBINE_STRANDS];
    __shared__ float strand_o[ATTN_COMBINE_STRANDS * MAX_D];
    const int tid = threadIdx.x;
    int lo, hi;
    attn_visible(positions, t, n_tokens, kv_len, window, &lo, &hi);
    const int c_first = lo / ATTN_DECODE_CHUNK;
    const int c_last = lo <= hi ? hi / ATTN_DECODE_CHUNK : c_first - 1;
    const long long base = ((long long)t * n_head + h) * n_chunks;
    for (int s = tid; s < ATTN_COMBINE_STRANDS; s += blockDim.x) {
        float top = ATTN_NEG_INF;
        for (int c = c_first + s; c <= c_last; c += ATTN_COMBINE_STRANDS) {
            top = fmaxf(top, partial_ml[2 * (base + c)]);
        }
        strand_top[s] = top;
    }
    __syncthreads();
    float top = sinks ? sinks[h] : ATTN_NEG_INF;
#pragma unroll
    for (int i = 0; i < ATTN_COMBINE_STRANDS; ++i) {
        top = fmaxf(top, strand_top[i]);
    }
    for (int i = tid; i < ATTN_COMBINE_STRANDS * head_dim; i += blockDim.x) {
        const int strand = i / head_dim;
        const int d = i % head_dim;
        float l = 0.0f;
        float o = 0.0f;
        for (int c = c_first + strand; c <= c_last; c += ATTN_COMBINE_STRANDS) {
            const float m = partial_ml[2 * (base + c)];
            if (m != ATTN_NEG_INF) {
                const float w = expf(m - top);
                l = fmaf(partial_ml[2 * (base + c) + 1], w, l);
                o = fmaf(partial_o[(base + c) * head_dim + d], w, o);
            }
        }
        if (d == 0) {
            strand_l[strand] = l;
        }
        strand_o[strand * head_dim + d] = o;
    }
    __syncthreads();
    for (int d = tid; d < head_dim; d += blockDim.x) {
        float l = strand_l[0];
        float o = strand_o[d];
#pragma unroll
        for (int i = 1; i < ATTN_COMBINE_STRANDS; ++i) {
            l += strand_l[i];
            o += strand_o[i * head_dim + d];
        }
        if (sinks) {
            l += expf(sinks[h] - top);
        }
        out[((long long)t * n_head + h) * head_dim + d] = l > 0.0f ? o / l : 0.0f;
    }
    __syncthreads();  // a next row may overwrite the strands' sums
}

// One block per (head, token) = (blockIdx.x, blockIdx.y), head_dim * ATTN_COMBINE_STRANDS threads, at most
// 1024 (wider heads' (strand, d) pairs take turns).
extern "C" __global__ void __launch_bounds__(1024) attn_decode_combine(const float* __restrict__ partial_ml,
                                               const float* __restrict__ partial_o, const int* __restrict__ positions,
                                               const float* __restrict__ sinks, float* __restrict__ out,
                                               int n_tokens, int kv_len, int n_head, int window, int n_chunks,
                                               int head_dim) {
    KERNEL_PROLOGUE();
    attn_combine_row<const float* __restrict__, ATTN_COMBINE_MAX_D>(partial_ml, partial_o, positions, sinks, out,
                                                                    blockIdx.y, blockIdx.x, n_tokens, kv_len, n_head,
                                                                    window, n_chunks, head_dim);
}

// attn_decode_d* then attn_decode_combine in one launch (the grid and block of attn_decode_d*): each block
// writes its chunk's partials, then counts itself done in counters[blockIdx.z * gridDim.y + blockIdx.y]
// (atomicInc, which wraps the group's last count back to 0 for the next launch; each must hold 0 before
// the first); the last of that (KV head, rows) group's n_chunks blocks to count, once every block's
// partials are visible, combines the group's rows as attn_decode_combine does. The bytes of the two
// launches.
template <int D>
__device__ void attn_decode_fused(ATTN_DECODE_PARAMS, const float* __restrict__ sinks, float* __restrict__ out,
                                  unsigned int* counters) {
    __shared__ int last;
    attn_decode_chunk<D>(ATTN_DECODE_ARGS);  // a block whose chunk no row sees writes nothing, but counts
    __threadfence();  // this thread's partials are visible to every block before the block counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(counters + blockIdx.z * gridDim.y + blockIdx.y, gridDim.x - 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;  // the whole block returns together
    }
    __threadfence();
    const int group = n_head / n_head_kv;
    for (int r = 0; r < ATTN_DECODE_ROWS; ++r) {
        const int row = blockIdx.z * ATTN_DECODE_ROWS + r;
        if (row / group >= n_tokens) {
            break;
        }
        attn_combine_row<const volatile float*, D>(partial_ml, partial_o, positions, sinks, out, row / group,
                                                blockIdx.y * group + row % group, n_tokens, kv_len, n_head, window,
                                                n_chunks, D);
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_fused_d64(
    ATTN_DECODE_PARAMS, const float* __restrict__ sinks, float* __restrict__ out, unsigned int* counters) {
    KERNEL_PROLOGUE();
    attn_decode_fused<64>(ATTN_DECODE_ARGS, sinks, out, counters);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_fused_d128(
    ATTN_DECODE_PARAMS, const float* __restrict__ sinks, float* __restrict__ out, unsigned int* counters) {
    KERNEL_PROLOGUE();
    attn_decode_fused<128>(ATTN_DECODE_ARGS, sinks, out, counters);
}

// ---------------------------------------------------------------------------------
// Wide heads (qwen3next's 256; deepseek2's latent attention, one shared KV head of 512 + 64):
// attn_wide_d*, for any number of tokens. Block (x, g) serves rows x * ATTN_WIDE_ROWS .. of KV head g's n_tokens x group
// (token, head) rows (decode's order), its 16 threads a row; it stages its rows' queries and tiles
// of ATTN_WIDE_KEYS keys (the key tile, not the value one, fits 48 KB beside the queries at these
// widths) and reads each value row straight from the cache, the rows of one tile shared by all the
// block's rows through the cache hierarchy. Value rows outside the union of the rows' ranges are
// never read; a row's own mask makes its weights 0 elsewhere.
// ---------------------------------------------------------------------------------

#define ATTN_WIDE_ROWS 8
#define ATTN_WIDE_KEYS 16
static_assert(ATTN_WIDE_ROWS == ATTN_DECODE_ROWS, "the wide decode takes the split-K decode's grid");

template <int D> struct AttnWide {
    static const int TPR = ATTN_THREADS / ATTN_WIDE_ROWS;  // threads of a row: one key of a tile each
    static const int WORDS = D / 2 / TPR;                  // f16 pairs of the output a thread owns
    static const int Q_LD = D + 1;
    static const int K_LD = D / 2 + 1;  // words per key row: odd, the rows a warp reads in distinct banks
    static_assert(TPR == ATTN_WIDE_KEYS && (D / 2) % TPR == 0 && D % 8 == 0, "a key a thread, even split");
    static_assert(ATTN_DECODE_CHUNK % ATTN_WIDE_KEYS == 0, "decode chunks hold whole tiles");

    struct Shared {
        float q[ATTN_WIDE_ROWS * Q_LD];
        unsigned int k[ATTN_WIDE_KEYS * K_LD];
        float s[ATTN_WIDE_ROWS * (ATTN_WIDE_KEYS + 1)];
        int lo[ATTN_WIDE_ROWS];
        int hi[ATTN_WIDE_ROWS];
        int token[ATTN_WIDE_ROWS];
        int head[ATTN_WIDE_ROWS];
    };
};

// The block's rows (row_block * ATTN_WIDE_ROWS .. of KV head g's n_tokens x group rows) over cache rows
// [key_begin, key_end): leaves this thread's row's m, l and unnormalized o (its 2 * WORDS values) and
// the row's token (-1: none) and head.
template <int D>
__device__ void attn_wide_rows(typename AttnWide<D>::Shared& sh, const float* __restrict__ q,
                               const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache,
                               const int* __restrict__ positions, int n_tokens, int kv_len, int n_head,
                               int n_head_kv, int window, float scale, int row_block, int g, int key_begin,
                               int key_end, float* m_out, float* l_out, float* o) {
    typedef AttnWide<D> A;
    const int tid = threadIdx.x;
    const int r = tid / A::TPR;
    const int c = tid % A::TPR;
    const int group = n_head / n_head_kv;
    if (tid < ATTN_WIDE_ROWS) {
        const int row = row_block * ATTN_WIDE_ROWS + tid;
        sh.token[tid] = row / group < n_tokens ? row / group : -1;
        sh.head[tid] = g * group + row % group;
        attn_visible(positions, sh.token[tid], n_tokens, kv_len, window, &sh.lo[tid], &sh.hi[tid]);
    }
    __syncthreads();
    for (int i = tid; i < ATTN_WIDE_ROWS * D; i += ATTN_THREADS) {
        const int rr = i / D;
        const int t = sh.token[rr];
        sh.q[rr * A::Q_LD + i % D] = t >= 0 ? q[((long long)t * n_head + sh.head[rr]) * D + i % D] : 0.0f;
    }
    int first, last;
    attn_union(sh.lo, sh.hi, ATTN_WIDE_ROWS, key_begin, key_end, &first, &last);
    const int row_lo = sh.lo[r];
    const int row_hi = sh.hi[r];
    const float* q_row = sh.q + r * A::Q_LD;
    float m = ATTN_NEG_INF;
    float l = 0.0f;
#pragma unroll
    for (int i = 0; i < 2 * A::WORDS; ++i) {
        o[i] = 0.0f;
    }
    const int PARTS = D / 8;  // 16-byte parts of a cache row
    for (int j0 = first - first % ATTN_WIDE_KEYS; j0 <= last; j0 += ATTN_WIDE_KEYS) {
        __syncthreads();  // the queries are staged; the tile before is no longer read
        for (int i = tid; i < ATTN_WIDE_KEYS * PARTS; i += ATTN_THREADS) {
            const int jr = i / PARTS;
            const int part = i % PARTS;
            const int j = j0 + jr;
            attn_words4 kw = {0u, 0u, 0u, 0u};
            if (j >= first && j <= last) {
                kw = *(const attn_words4*)(k_cache + ((long long)j * n_head_kv + g) * D + 8 * part);
            }
            unsigned int* k_to = sh.k + jr * A::K_LD + 4 * part;
            k_to[0] = kw.x;
            k_to[1] = kw.y;
            k_to[2] = kw.z;
            k_to[3] = kw.w;
        }
        __syncthreads();
        {
            const float acc = attn_dot_staged<D>(q_row, sh.k + c * A::K_LD);
            const int j = j0 + c;
            sh.s[r * (ATTN_WIDE_KEYS + 1) + c] = j >= row_lo && j <= row_hi ? acc * scale : ATTN_NEG_INF;
        }
        __syncthreads();
        const float* s_row = sh.s + r * (ATTN_WIDE_KEYS + 1);
        float tile_max = ATTN_NEG_INF;
        for (int jr = 0; jr < ATTN_WIDE_KEYS; ++jr) {
            tile_max = fmaxf(tile_max, s_row[jr]);
        }
        const float m_new = fmaxf(m, tile_max);
        const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;  // a row that saw nothing stays at zeros
        const float alpha = expf(m - m_use);
        m = m_new;
        l *= alpha;
#pragma unroll
        for (int i = 0; i < 2 * A::WORDS; ++i) {
            o[i] *= alpha;
        }
        const int j_end = min(ATTN_WIDE_KEYS, last - j0 + 1);
        for (int jr = max(0, first - j0); jr < j_end; ++jr) {  // the union's rows only: others may hold NaN
            const float p = expf(s_row[jr] - m_use);
            l += p;
            const unsigned int* v_row =
                (const unsigned int*)(v_cache + ((long long)(j0 + jr) * n_head_kv + g) * D) + c;
#pragma unroll
            for (int u = 0; u < A::WORDS; ++u) {
                const unsigned int vw = v_row[A::TPR * u];
                o[2 * u] = fmaf(p, attn_half_low(vw), o[2 * u]);
                o[2 * u + 1] = fmaf(p, attn_half_high(vw), o[2 * u + 1]);
            }
        }
    }
    *m_out = m;
    *l_out = l;
}

// Prefill (any number of tokens): block (x, g) takes row block x over every cache row and writes out.
template <int D>
__device__ void attn_wide(ATTN_PREFILL_PARAMS) {
    typedef AttnWide<D> A;
    __shared__ typename A::Shared sh;
    float m, l, o[2 * A::WORDS];
    attn_wide_rows<D>(sh, q, k_cache, v_cache, positions, n_tokens, kv_len, n_head, n_head_kv, window, scale,
                      blockIdx.x, blockIdx.y, 0, kv_len, &m, &l, o);
    const int r = threadIdx.x / A::TPR;
    const int c = threadIdx.x % A::TPR;
    const int t = sh.token[r];
    if (t < 0) {
        return;
    }
    const int h = sh.head[r];
    const float keep = sinks ? attn_join_sink(m, &l, sinks[h]) : 1.0f;
    const float inv = l > 0.0f ? keep / l : 0.0f;
    float* out_row = out + ((long long)t * n_head + h) * D;
#pragma unroll
    for (int u = 0; u < A::WORDS; ++u) {
        const int w = c + A::TPR * u;
        *(attn_float2*)(out_row + 2 * w) = attn_float2{o[2 * u] * inv, o[2 * u + 1] * inv};
    }
}

// Split-K decode with attn_decode_d*'s grid, arguments and partials (attn_decode_combine merges them):
// block (chunk, g, z) takes row block z over keys [chunk * ATTN_DECODE_CHUNK, + ATTN_DECODE_CHUNK).
template <int D>
__device__ void attn_wide_decode(ATTN_DECODE_PARAMS) {
    typedef AttnWide<D> A;
    __shared__ typename A::Shared sh;
    const int chunk = blockIdx.x;
    const int key_begin = chunk * ATTN_DECODE_CHUNK;
    const int group = n_head / n_head_kv;
    // Every thread decides alike whether any row sees this chunk, so the block returns as one.
    bool seen = false;
    for (int rr = 0; rr < ATTN_WIDE_ROWS; ++rr) {
        int lo, hi;
        attn_visible(positions, (blockIdx.z * ATTN_WIDE_ROWS + rr) / group, n_tokens, kv_len, window, &lo, &hi);
        seen = seen || (lo <= hi && lo < key_begin + ATTN_DECODE_CHUNK && hi >= key_begin);
    }
    if (!seen) {
        return;
    }
    float m, l, o[2 * A::WORDS];
    attn_wide_rows<D>(sh, q, k_cache, v_cache, positions, n_tokens, kv_len, n_head, n_head_kv, window, scale,
                      blockIdx.z, blockIdx.y, key_begin, key_begin + ATTN_DECODE_CHUNK, &m, &l, o);
    const int r = threadIdx.x / A::TPR;
    const int c = threadIdx.x % A::TPR;
    if (sh.token[r] < 0) {
        return;
    }
    const long long at = ((long long)sh.token[r] * n_head + sh.head[r]) * n_chunks + chunk;
    if (c == 0) {
        partial_ml[2 * at] = m;
        partial_ml[2 * at + 1] = l;
    }
    float* o_row = partial_o + at * D;
#pragma unroll
    for (int u = 0; u < A::WORDS; ++u) {
        const int w = c + A::TPR * u;
        *(attn_float2*)(o_row + 2 * w) = attn_float2{o[2 * u], o[2 * u + 1]};
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_wide_d256(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide<256>(ATTN_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_wide_d576(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide<576>(ATTN_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_wide_decode_d256(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_decode<256>(ATTN_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_wide_decode_d576(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_decode<576>(ATTN_DECODE_ARGS);
}

// ---------------------------------------------------------------------------------
// The matrix-core prefill on NVIDIA: 4 warps, each 16 queries of the block's 64, all against the same
// double-buffered tiles of ATTN_KEYS keys (cp.async, zero-filled outside the block's union).
// A warp keeps its queries' A fragments (scale * q, f16) in registers for the whole kernel;
// per tile it takes S = Q K^T (16 x 32, C fragments), masks, updates m and l (each lane its
// columns' share of l, summed over the quad at the end), rounds P to f16 straight from the C
// fragments into A fragments (mma.sync's C layout of two n8 tiles is its A layout of one k16
// step), and adds P V (V fragments by ldmatrix .trans). A warp whose queries see none of a
// tile skips it.
// ---------------------------------------------------------------------------------

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ATTN_MMA_NVIDIA 1
#endif

// The wide matrix-core prefill's block (below; its layout's size is checked on the host too).
#define ATTN_WIDE_MMA_ROWS 64
#define ATTN_WIDE_MMA_THREADS 256

template <int D, bool KV_SHARED> struct AttnWideMma {
    static const int LD = D + 8;  // halves per staged row: 16-byte rows, ldmatrix's 8 rows in distinct banks
    static const int S_LD = ATTN_KEYS + 4;  // floats per score row: 16-byte rows, read four floats at a time
    static const int P_LD = ATTN_KEYS + 8;  // halves per P row
    static const int HALF = D / 2;          // output columns a warp owns
    static const int PARTS = D / 8;         // 16-byte parts of a cache row
    static const int TILE = ATTN_KEYS * LD;  // halves of one staged key (or value) tile
    static const int TILES = KV_SHARED ? 2 : 4;  // two buffers of keys, and of values where they differ
    // Must match attention.py's wide_mma_shared_bytes.
    static const int BYTES = 2 * (ATTN_WIDE_MMA_ROWS * LD + TILES * TILE) + 4 * ATTN_WIDE_MMA_ROWS * S_LD +
                             2 * ATTN_WIDE_MMA_ROWS * P_LD + 5 * 4 * ATTN_WIDE_MMA_ROWS;
    static_assert(ATTN_KEYS == 32 && ATTN_WIDE_MMA_THREADS == 4 * ATTN_WIDE_MMA_ROWS, "four threads a row");
    static_assert(HALF % 16 == 0 && D % 16 == 0, "whole k16 steps and n8 pairs");
};


#if defined(ATTN_MMA_NVIDIA)

__device__ unsigned int attn_pack_half2(float low, float high) {
    unsigned int packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

__device__ void attn_ldmatrix_x4_trans(unsigned int* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p))
                 : "memory");
}

__device__ void attn_mma_f16(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes from global to shared, or zeros (nothing read) when bytes is 0.
__device__ void attn_copy16(unsigned short* to, const unsigned short* from, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(to)), "l"(from), "r"(bytes)
                 : "memory");
}

__device__ float attn_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ float attn_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int D> struct AttnMma {
    static const int LD = D + 8;  // halves per shared row: 16-byte rows, ldmatrix's 8 rows in distinct banks
    static const int PARTS = D / 8;
    static const int DT = D / 8;  // n8 tiles of the output
};

#define ATTN_LOG2E 1.4426950408889634f

// 2^x in one special-function instruction (flushes subnormal results to zero; 2^-inf = 0).
__device__ __forceinline__ float attn_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The online-softmax update of one query row (this lane's two columns of each of the four n8
// tiles, s[nt][half * 2 + e]) for a tile; returns alpha, what o is rescaled by. The scores are in
// base 2 (the queries carry log2(e)), so each exponential is one ex2 of a difference.
__device__ __forceinline__ float attn_mma_row_update(float (*s)[4], int half, float* m, float* l) {
    float tile_max = ATTN_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    }
    const float m_new = fmaxf(*m, attn_quad_max(tile_max));
    const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;
    const float alpha = attn_exp2(*m - m_use);
    *m = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[nt][2 * half + e] = attn_exp2(s[nt][2 * half + e] - m_use);
            sum += s[nt][2 * half + e];
        }
    }
    *l = *l * alpha + sum;
    return alpha;
}

// attn_join_sink for a row whose m is in base 2 (the sink logit is not: it is scaled here).
__device__ float attn_join_sink_log2(float m, float* l, float sink) {
    const float sink2 = sink * ATTN_LOG2E;
    const float top = fmaxf(m, sink2);
    const float keep = m == ATTN_NEG_INF ? 0.0f : attn_exp2(m - top);
    *l = *l * keep + attn_exp2(sink2 - top);
    return keep;
}

template <int D, int WARPS>
__device__ void attn_prefill_mma(ATTN_PREFILL_PARAMS) {
    typedef AttnMma<D> M;
    const int ROWS = 16 * WARPS;  // queries a block: 16 a warp
    const int THREADS = 32 * WARPS;
    static_assert(ATTN_KEYS == 32, "the tile step takes four n8 tiles of keys");
    __shared__ __attribute__((aligned(16))) unsigned short k_tile[2][ATTN_KEYS * M::LD];
    __shared__ __attribute__((aligned(16))) unsigned short v_tile[2][ATTN_KEYS * M::LD];
    __shared__ int row_lo[ROWS];
    __shared__ int row_hi[ROWS];
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int head = blockIdx.y;
    const int g = head / (n_head / n_head_kv);
    const int first_token = blockIdx.x * ROWS;
    if (tid < ROWS) {
        attn_visible(positions, first_token + tid, n_tokens, kv_len, window, &row_lo[tid], &row_hi[tid]);
    }
    // This lane's rows of the warp's 16: r0 and r0 + 8 (C and A fragment rows), columns c2, c2 + 1.
    const int r0 = warp * 16 + lane / 4;
    const int c2 = 2 * (lane % 4);
    const float q_scale = scale * ATTN_LOG2E;  // scores in base 2
    unsigned int qa[D / 16][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = first_token + r0 + 8 * half;
        const float* q_row = q + ((long long)(t < n_tokens ? t : 0) * n_head + head) * D;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            attn_float2 a = {0.0f, 0.0f};
            attn_float2 b = a;
            if (t < n_tokens) {
                a = *(const attn_float2*)(q_row + 16 * ks + c2);
                b = *(const attn_float2*)(q_row + 16 * ks + c2 + 8);
            }
            qa[ks][half] = attn_pack_half2(a.x * q_scale, a.y * q_scale);
            qa[ks][2 + half] = attn_pack_half2(b.x * q_scale, b.y * q_scale);
        }
    }
    __syncthreads();
    int first = kv_len;
    int last = -1;
    int warp_first = kv_len;
    int warp_last = -1;
    // [seen_lo, seen_hi]: the keys every query of the warp sees, so a tile inside it needs no mask
    // (queries past n_tokens are written nowhere; a query that sees nothing empties it).
    int seen_lo = 0;
    int seen_hi = kv_len - 1;
    for (int i = 0; i < ROWS; ++i) {
        const bool sees = row_lo[i] <= row_hi[i];
        if (sees) {
            first = min(first, row_lo[i]);
            last = max(last, row_hi[i]);
        }
        if (i / 16 == warp) {
            if (sees) {
                warp_first = min(warp_first, row_lo[i]);
                warp_last = max(warp_last, row_hi[i]);
                seen_lo = max(seen_lo, row_lo[i]);
                seen_hi = min(seen_hi, row_hi[i]);
            } else if (first_token + i < n_tokens) {
                seen_hi = -1;
            }
        }
    }
    const int lo[2] = {row_lo[r0], row_lo[r0 + 8]};
    const int hi[2] = {row_hi[r0], row_hi[r0 + 8]};
    const int j_start = first - first % ATTN_KEYS;
    const int n_tiles = last >= first ? (last - j_start) / ATTN_KEYS + 1 : 0;

    auto stage = [&](int tile, int buf) {
        for (int i = tid; i < ATTN_KEYS * M::PARTS; i += THREADS) {
            const int jr = i / M::PARTS;
            const int part = i % M::PARTS;
            const int j = j_start + tile * ATTN_KEYS + jr;
            const bool inside = j >= first && j <= last;
            const long long at = ((long long)(inside ? j : first) * n_head_kv + g) * D + 8 * part;
            attn_copy16(k_tile[buf] + jr * M::LD + 8 * part, k_cache + at, inside ? 16 : 0);
            attn_copy16(v_tile[buf] + jr * M::LD + 8 * part, v_cache + at, inside ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

    float o[M::DT][4];
#pragma unroll
    for (int dt = 0; dt < M::DT; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[dt][e] = 0.0f;
        }
    }
    float m[2] = {ATTN_NEG_INF, ATTN_NEG_INF};
    float l[2] = {0.0f, 0.0f};
    if (n_tiles > 0) {
        stage(0, 0);
    }
    for (int tile = 0; tile < n_tiles; ++tile) {
        if (tile + 1 < n_tiles) {
            stage(tile + 1, (tile + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();
        const int j0 = j_start + tile * ATTN_KEYS;
        if (j0 <= warp_last && j0 + ATTN_KEYS - 1 >= warp_first) {  // the same for the whole warp
            const unsigned short* kt = k_tile[tile & 1];
            const unsigned short* vt = v_tile[tile & 1];
            float s[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = 0.0f;
                }
            }
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
                for (int pair = 0; pair < 2; ++pair) {
                    unsigned int b[4];
                    ldmatrix_x4(b, kt + (16 * pair + (lane / 16) * 8 + lane % 8) * M::LD + 16 * ks + ((lane / 8) % 2) * 8);
                    attn_mma_f16(s[2 * pair], qa[ks], b[0], b[1]);
                    attn_mma_f16(s[2 * pair + 1], qa[ks], b[2], b[3]);
                }
            }
            if (j0 < seen_lo || j0 + ATTN_KEYS - 1 > seen_hi) {  // the same for the whole warp
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int j = j0 + 8 * nt + c2 + e % 2;
                        if (j < lo[e / 2] || j > hi[e / 2]) {
                            s[nt][e] = ATTN_NEG_INF;
                        }
                    }
                }
            }
            const float alpha0 = attn_mma_row_update(s, 0, &m[0], &l[0]);
            const float alpha1 = attn_mma_row_update(s, 1, &m[1], &l[1]);
#pragma unroll
            for (int dt = 0; dt < M::DT; ++dt) {
                o[dt][0] *= alpha0;
                o[dt][1] *= alpha0;
                o[dt][2] *= alpha1;
                o[dt][3] *= alpha1;
            }
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
                const unsigned int pa[4] = {
                    attn_pack_half2(s[2 * kc][0], s[2 * kc][1]), attn_pack_half2(s[2 * kc][2], s[2 * kc][3]),
                    attn_pack_half2(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                    attn_pack_half2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
                for (int dt2 = 0; dt2 < D / 16; ++dt2) {
                    unsigned int b[4];
                    attn_ldmatrix_x4_trans(
                        b, vt + (16 * kc + ((lane / 8) % 2) * 8 + lane % 8) * M::LD + 16 * dt2 + (lane / 16) * 8);
                    attn_mma_f16(o[2 * dt2], pa, b[0], b[1]);
                    attn_mma_f16(o[2 * dt2 + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // the next stage overwrites this buffer
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = first_token + r0 + 8 * half;
        float row_l = attn_quad_sum(l[half]);  // every lane takes part in the shuffles
        if (t >= n_tokens) {
            continue;
        }
        const float keep = sinks ? attn_join_sink_log2(m[half], &row_l, sinks[head]) : 1.0f;
        const float inv = row_l > 0.0f ? keep / row_l : 0.0f;
        float* out_row = out + ((long long)t * n_head + head) * D;
#pragma unroll
        for (int dt = 0; dt < M::DT; ++dt) {
            *(attn_float2*)(out_row + 8 * dt + c2) = attn_float2{o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv};
        }
    }
}

// ---------------------------------------------------------------------------------
// Wide heads on the matrix cores (NVIDIA sm_80+; the launcher picks them where
// Capabilities.mma_fragments is set and the block's shared memory fits): attn_wide_mma_d256
// (qwen3next, keys and values in caches of their own) and attn_wide_mma_d576 (deepseek2's latent
// attention: the value is the first columns of the key's own row, v_cache == k_cache, so one staged
// tile serves both). One block of 8 warps per (64 rows, KV head), rows mapped as attn_wide_d* maps
// them ((token, head) pairs of the KV head's group, token-major). The queries are staged once as
// scale * q in f16, keys (and values) in double-buffered tiles of ATTN_KEYS (cp.async, zeros
// outside the block's union of visible rows). Per tile, a barrier between each step:
//   1. warp w takes S for rows 16 (w % 4) .. + 15 against keys 16 (w / 4) .. + 15 of the tile
//      (two interleaved k chains each, added at the end) into the score tile;
//   2. four threads a row mask it, update the row's running max and sum over the tile (quad
//      shuffles, a fixed order) and write its P (f16) and the factor its o is rescaled by;
//   3. warp w rescales and adds P V for rows 16 (w % 4) .. + 15, output columns (w / 4) D / 2 ..
//      + D / 2 - 1 (held in registers: 144 floats a lane at D = 576).
// Staging the next tile overlaps all three. Results are the prefill's, as attn_prefill_mma_d*
// rounds them (f16 Q and P, float32 sums); the grid's row blocks never read each other's rows.
// ---------------------------------------------------------------------------------

// The block's shared memory, laid out as AttnWideMma::BYTES counts it.
template <int D, bool KV_SHARED> struct AttnWideMmaShared {
    unsigned short* q;
    unsigned short* k;  // key buffers 0, 1, then value buffers 0, 1 where separate
    float* s;
    unsigned short* p;
    int* lo;
    int* hi;
    int* token;
    float* alpha;
    float* inv;
};

template <int D, bool KV_SHARED>
__device__ __forceinline__ AttnWideMmaShared<D, KV_SHARED> attn_wide_mma_shared() {
    typedef AttnWideMma<D, KV_SHARED> W;
    const int ROWS = ATTN_WIDE_MMA_ROWS;
    extern __shared__ __attribute__((aligned(16))) unsigned char attn_dynamic_shared[];
    unsigned int granted;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(granted));
    if (granted < (unsigned int)W::BYTES) {
        __trap();  // a launch with less shared memory than the layout below would read past it
    }
    AttnWideMmaShared<D, KV_SHARED> sh;
    sh.q = (unsigned short*)attn_dynamic_shared;
    sh.k = sh.q + ROWS * W::LD;
    sh.s = (float*)(sh.k + W::TILES * W::TILE);
    sh.p = (unsigned short*)(sh.s + ROWS * W::S_LD);
    sh.lo = (int*)(sh.p + ROWS * W::P_LD);
    sh.hi = sh.lo + ROWS;
    sh.token = sh.hi + ROWS;
    sh.alpha = (float*)(sh.token + ROWS);
    sh.inv = sh.alpha + ROWS;
    return sh;
}

// Rows row0 .. + 63 of KV head g over cache rows [key_begin, key_end): leaves each thread's row sr's
// (tid / 4) m and l and its warp's unnormalized o (rows 16 (warp % 4) .., columns (warp / 4) D / 2 ..);
// false, with nothing staged, where no row sees any of those keys (the same in every thread).
template <int D, bool KV_SHARED>
__device__ __forceinline__ bool attn_wide_mma_rows(const AttnWideMmaShared<D, KV_SHARED>& sh,
                                                   const float* __restrict__ q,
                                                   const unsigned short* __restrict__ k_cache,
                                                   const unsigned short* __restrict__ v_cache,
                                                   const int* __restrict__ positions, int n_tokens, int kv_len,
                                                   int n_head, int n_head_kv, int window, float scale, int row0,
                                                   int key_begin, int key_end, float* m_out, float* l_out,
                                                   float (*o)[4]) {
    typedef AttnWideMma<D, KV_SHARED> W;
    const int ROWS = ATTN_WIDE_MMA_ROWS;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = blockIdx.y;
    const int group = n_head / n_head_kv;
    if (tid < ROWS) {
        const int row = row0 + tid;
        sh.token[tid] = row / group < n_tokens ? row / group : -1;
        attn_visible(positions, sh.token[tid], n_tokens, kv_len, window, &sh.lo[tid], &sh.hi[tid]);
    }
    __syncthreads();
    int first, last;
    attn_union(sh.lo, sh.hi, ROWS, key_begin, key_end, &first, &last);
    if (last < first) {
        return false;
    }
    for (int i = tid; i < ROWS * (D / 2); i += ATTN_WIDE_MMA_THREADS) {
        const int r = i / (D / 2);
        const int c = 2 * (i % (D / 2));
        const int t = sh.token[r];
        attn_float2 v = {0.0f, 0.0f};
        if (t >= 0) {
            v = *(const attn_float2*)(q + ((long long)t * n_head + g * group + (row0 + r) % group) * D + c);
        }
        *(unsigned int*)(sh.q + r * W::LD + c) = attn_pack_half2(v.x * scale, v.y * scale);
    }
    const int j_start = first - first % ATTN_KEYS;
    const int n_tiles = (last - j_start) / ATTN_KEYS + 1;

    auto stage = [&](int tile, int buf) {
        for (int i = tid; i < ATTN_KEYS * W::PARTS; i += ATTN_WIDE_MMA_THREADS) {
            const int jr = i / W::PARTS;
            const int part = i % W::PARTS;
            const int j = j_start + tile * ATTN_KEYS + jr;
            const bool inside = j >= first && j <= last;
            const long long at = ((long long)(inside ? j : first) * n_head_kv + g) * D + 8 * part;
            attn_copy16(sh.k + buf * W::TILE + jr * W::LD + 8 * part, k_cache + at, inside ? 16 : 0);
            if (!KV_SHARED) {
                attn_copy16(sh.k + (2 + buf) * W::TILE + jr * W::LD + 8 * part, v_cache + at, inside ? 16 : 0);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

    // Steps 1 and 3: this warp's 16 rows, its keys of a tile (step 1) and its output columns (step 3).
    const int rows16 = 16 * (warp % 4);
    const int keys16 = 16 * (warp / 4);
    const int cols = W::HALF * (warp / 4);
    const int a_row = rows16 + lane % 8 + 8 * ((lane / 8) % 2);  // ldmatrix rows of an A fragment
    const int a_col = 8 * (lane / 16);
    // Step 2: row sr's keys 8 * quarter .. + 7; m and l are the same in the row's four threads.
    const int sr = tid / 4;
    const int quarter = tid % 4;
    float m = ATTN_NEG_INF;
    float l = 0.0f;
#pragma unroll
    for (int dt = 0; dt < W::HALF / 8; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[dt][e] = 0.0f;
        }
    }
    stage(0, 0);
    for (int tile = 0; tile < n_tiles; ++tile) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();  // this tile has landed for every thread; the last tile's P V is done
        if (tile + 1 < n_tiles) {
            stage(tile + 1, (tile + 1) & 1);
        }
        const unsigned short* kt = sh.k + (tile & 1) * W::TILE;
        const unsigned short* vt = KV_SHARED ? kt : sh.k + (2 + (tile & 1)) * W::TILE;
        const int j0 = j_start + tile * ATTN_KEYS;
        {
            float s[2][2][4];  // [k chain][n8 tile][C element]
#pragma unroll
            for (int x = 0; x < 16; ++x) {
                s[x / 8][(x / 4) % 2][x % 4] = 0.0f;
            }
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                unsigned int a[4];
                unsigned int b[4];
                ldmatrix_x4(a, sh.q + a_row * W::LD + 16 * ks + a_col);
                ldmatrix_x4(b, kt + (keys16 + (lane / 16) * 8 + lane % 8) * W::LD + 16 * ks + ((lane / 8) % 2) * 8);
                attn_mma_f16(s[ks % 2][0], a, b[0], b[1]);
                attn_mma_f16(s[ks % 2][1], a, b[2], b[3]);
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = rows16 + lane / 4 + 8 * half;
                    const int c = keys16 + 8 * nt + 2 * (lane % 4);
                    *(attn_float2*)(sh.s + r * W::S_LD + c) =
                        attn_float2{s[0][nt][2 * half] + s[1][nt][2 * half],
                                    s[0][nt][2 * half + 1] + s[1][nt][2 * half + 1]};
                }
            }
        }
        __syncthreads();
        {
            const int lo = max(sh.lo[sr], first);  // the launch's keys only
            const int hi = min(sh.hi[sr], last);
            const attn_float4 s0 = *(const attn_float4*)(sh.s + sr * W::S_LD + 8 * quarter);
            const attn_float4 s1 = *(const attn_float4*)(sh.s + sr * W::S_LD + 8 * quarter + 4);
            float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
            float tile_max = ATTN_NEG_INF;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int j = j0 + 8 * quarter + e;
                sv[e] = j >= lo && j <= hi ? sv[e] : ATTN_NEG_INF;
                tile_max = fmaxf(tile_max, sv[e]);
            }
            const float m_new = fmaxf(m, attn_quad_max(tile_max));
            const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;  // a row that saw nothing stays at zeros
            const float alpha = expf(m - m_use);
            m = m_new;
            float sum = 0.0f;
            unsigned int packed[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const float p0 = expf(sv[e] - m_use);
                const float p1 = expf(sv[e + 1] - m_use);
                sum += p0;
                sum += p1;
                packed[e / 2] = attn_pack_half2(p0, p1);
            }
            l = l * alpha + attn_quad_sum(sum);
            *(attn_words4*)(sh.p + sr * W::P_LD + 8 * quarter) =
                attn_words4{packed[0], packed[1], packed[2], packed[3]};
            if (quarter == 0) {
                sh.alpha[sr] = alpha;
            }
        }
        __syncthreads();
        {
            const float alpha0 = sh.alpha[rows16 + lane / 4];
            const float alpha1 = sh.alpha[rows16 + lane / 4 + 8];
#pragma unroll
            for (int dt = 0; dt < W::HALF / 8; ++dt) {
                o[dt][0] *= alpha0;
                o[dt][1] *= alpha0;
                o[dt][2] *= alpha1;
                o[dt][3] *= alpha1;
            }
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
                unsigned int pa[4];
                ldmatrix_x4(pa, sh.p + a_row * W::P_LD + 16 * kc + a_col);
#pragma unroll
                for (int dt2 = 0; dt2 < W::HALF / 16; ++dt2) {
                    unsigned int b[4];
                    attn_ldmatrix_x4_trans(
                        b, vt + (16 * kc + ((lane / 8) % 2) * 8 + lane % 8) * W::LD + cols + 16 * dt2 + (lane / 16) * 8);
                    attn_mma_f16(o[2 * dt2], pa, b[0], b[1]);
                    attn_mma_f16(o[2 * dt2 + 1], pa, b[2], b[3]);
                }
            }
        }
    }
    *m_out = m;
    *l_out = l;
    return true;
}

// Each of this thread's rows of its warp's output columns (attn_wide_mma_rows' o), written to the
// row of (token, head) at dst + ((token * n_head + head) * stride) * D, times the row's sh.inv where
// normalized (prefill's out: stride 1) and as they are otherwise (decode's partials: dst at the chunk,
// stride n_chunks). Rows past the last token write nothing.
template <int D, bool KV_SHARED>
__device__ __forceinline__ void attn_wide_mma_store(const AttnWideMmaShared<D, KV_SHARED>& sh,
                                                    const float (*o)[4], float* dst, long long stride,
                                                    int n_head, int group, int row0, bool normalized) {
    typedef AttnWideMma<D, KV_SHARED> W;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int cols = W::HALF * (warp / 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = 16 * (warp % 4) + lane / 4 + 8 * half;
        const int t = sh.token[r];
        if (t < 0) {
            continue;
        }
        const float inv = normalized ? sh.inv[r] : 1.0f;
        const long long row = (long long)t * n_head + blockIdx.y * group + (row0 + r) % group;
        float* out_row = dst + row * stride * D + cols + 2 * (lane % 4);
#pragma unroll
        for (int dt = 0; dt < W::HALF / 8; ++dt) {
            *(attn_float2*)(out_row + 8 * dt) = attn_float2{o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv};
        }
    }
}

// Prefill: block (x, g) takes rows 64 x .. of KV head g over every cache row and writes out.
template <int D, bool KV_SHARED>
__device__ void attn_wide_mma(ATTN_PREFILL_PARAMS) {
    typedef AttnWideMma<D, KV_SHARED> W;
    const AttnWideMmaShared<D, KV_SHARED> sh = attn_wide_mma_shared<D, KV_SHARED>();
    const int row0 = blockIdx.x * ATTN_WIDE_MMA_ROWS;
    const int group = n_head / n_head_kv;
    const int tid = threadIdx.x;
    float m = ATTN_NEG_INF;
    float l = 0.0f;
    float o[W::HALF / 8][4];
    if (!attn_wide_mma_rows<D, KV_SHARED>(sh, q, k_cache, v_cache, positions, n_tokens, kv_len, n_head, n_head_kv,
                                          window, scale, row0, 0, kv_len, &m, &l, o)) {
#pragma unroll
        for (int dt = 0; dt < W::HALF / 8; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[dt][e] = 0.0f;  // no row sees a key: zeros (and a sink's share of nothing)
            }
        }
    }
    if (tid % 4 == 0) {
        const int sr = tid / 4;
        const int head = blockIdx.y * group + (row0 + sr) % group;
        const float keep = sinks ? attn_join_sink(m, &l, sinks[head]) : 1.0f;
        sh.inv[sr] = l > 0.0f ? keep / l : 0.0f;
    }
    __syncthreads();
    attn_wide_mma_store<D, KV_SHARED>(sh, o, out, 1, n_head, group, row0, true);
}

// Split-K decode with attn_decode_d*'s arguments and partials (attn_decode_combine merges them):
// block (chunk, g, z) takes rows 64 z .. over keys [chunk * ATTN_DECODE_CHUNK, + ATTN_DECODE_CHUNK) and
// returns at once where none of its rows sees them.
template <int D, bool KV_SHARED>
__device__ void attn_wide_mma_decode(ATTN_DECODE_PARAMS) {
    typedef AttnWideMma<D, KV_SHARED> W;
    static_assert(ATTN_DECODE_CHUNK % ATTN_KEYS == 0, "a chunk holds whole tiles");
    const AttnWideMmaShared<D, KV_SHARED> sh = attn_wide_mma_shared<D, KV_SHARED>();
    const int chunk = blockIdx.x;
    const int row0 = blockIdx.z * ATTN_WIDE_MMA_ROWS;
    const int group = n_head / n_head_kv;
    const int tid = threadIdx.x;
    float m, l, o[W::HALF / 8][4];
    if (!attn_wide_mma_rows<D, KV_SHARED>(sh, q, k_cache, v_cache, positions, n_tokens, kv_len, n_head, n_head_kv,
                                          window, scale, row0, chunk * ATTN_DECODE_CHUNK,
                                          chunk * ATTN_DECODE_CHUNK + ATTN_DECODE_CHUNK, &m, &l, o)) {
        return;
    }
    const int head_of = blockIdx.y * group;
    if (tid % 4 == 0) {
        const int sr = tid / 4;
        const int t = sh.token[sr];
        if (t >= 0) {
            const long long at = ((long long)t * n_head + head_of + (row0 + sr) % group) * n_chunks + chunk;
            partial_ml[2 * at] = m;
            partial_ml[2 * at + 1] = l;
        }
    }
    attn_wide_mma_store<D, KV_SHARED>(sh, o, partial_o + (long long)chunk * D, n_chunks, n_head, group, row0, false);
}

extern "C" __global__ void __launch_bounds__(ATTN_WIDE_MMA_THREADS, 1) attn_wide_mma_d256(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_mma<256, false>(ATTN_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_WIDE_MMA_THREADS, 1) attn_wide_mma_d576(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_mma<576, true>(ATTN_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_WIDE_MMA_THREADS, 1) attn_wide_mma_decode_d256(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_mma_decode<256, false>(ATTN_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATTN_WIDE_MMA_THREADS, 1) attn_wide_mma_decode_d576(ATTN_DECODE_PARAMS) {
    KERNEL_PROLOGUE();
    attn_wide_mma_decode<576, true>(ATTN_DECODE_ARGS);
}


#else  // not ATTN_MMA_NVIDIA

// ---------------------------------------------------------------------------------
// The matrix-core prefill on mma.cu's interface (AMD's MFMA and WMMA, the generic step elsewhere):
// the block's 64 queries in 16-query blocks, BLOCKS per wave, against staged tiles of ATTN_KEYS keys.
// K is staged as stored and V transposed, so both are B blocks with k contiguous (k = d for
// S = Q K^T, k = key for O = P V). A wave keeps its queries' A fragments (scale * q, f16) for the
// whole kernel. Per tile:
//   1. all threads stage K and V^T (zeros outside the block's union of visible rows);
//   2. each wave that sees the tile takes S for its rows into the score tile, from the C elements
//      its lanes hold (mma_row, mma_col), so no step depends on how a target spreads C over lanes;
//   3. thread r (r < 64) updates query row r's running max and sum over the whole tile, in key
//      order, and writes the row's P as f16 over the start of its own score row and the factor
//      its o is rescaled by;
//   4. each wave that sees the tile rescales its O blocks and adds P V.
// A barrier separates the steps, and the next tile's staging waits for step 4. A wave whose queries
// see none of a tile skips steps 2 and 4: its rows keep m, l and o (alpha is 1, or 0 where o is
// still 0), and their P is 0. P shares the score tile so that the block's shared memory stays
// under 48 KB at D = 128 (46 KB), the static limit of the NVIDIA targets before sm_80 that
// compile this branch.
// ---------------------------------------------------------------------------------

template <int D> struct AttnWaves {
    static const int BLOCKS = ATTN_MMA_ROWS / 16 / (ATTN_THREADS / MMA_WAVE);  // 16-query blocks per wave
    static const int KS = D / 16;            // k steps of Q K^T, and 16-column blocks of O
    static const int LD = D + 8;             // halves per Q and K row: 16-byte aligned, rows spread over banks
    static const int VT_LD = ATTN_KEYS + 8;  // halves per V^T row (one row per d)
    static const int S_LD = ATTN_KEYS + 4;   // floats per score row: 16-byte aligned for P's fragment loads
    static const int P_LD = 2 * S_LD;        // halves per P row, P row r at the start of score row r
    static_assert(ATTN_MMA_ROWS % (16 * (ATTN_THREADS / MMA_WAVE)) == 0, "whole query blocks per wave");
    static_assert(ATTN_KEYS == 32 && ATTN_MMA_ROWS <= ATTN_THREADS, "two key blocks per tile, a thread per row");

    struct Shared {
        __attribute__((aligned(16))) unsigned short q[ATTN_MMA_ROWS * LD];
        __attribute__((aligned(16))) unsigned short k[ATTN_KEYS * LD];
        __attribute__((aligned(16))) unsigned short vt[D * VT_LD];
        __attribute__((aligned(16))) float s[ATTN_MMA_ROWS * S_LD];
        float alpha[ATTN_MMA_ROWS];  // what a row's o is rescaled by for the current tile
        float inv[ATTN_MMA_ROWS];    // 1 / l, the sink joined, at the end
        int lo[ATTN_MMA_ROWS];
        int hi[ATTN_MMA_ROWS];
    };
};

// Step 3 for query row r over the tile at j0: returns alpha. The row's scores are all read before
// any of its P is written (every P depends on the tile's max), so P may overwrite them.
template <int D>
__device__ float attn_waves_row_update(typename AttnWaves<D>::Shared& sh, int r, int j0, float* m, float* l) {
    typedef AttnWaves<D> W;
    const float* s_row = sh.s + r * W::S_LD;
    float score[ATTN_KEYS];
    float tile_max = ATTN_NEG_INF;
#pragma unroll
    for (int jr = 0; jr < ATTN_KEYS; ++jr) {
        const int j = j0 + jr;
        score[jr] = j >= sh.lo[r] && j <= sh.hi[r] ? s_row[jr] : ATTN_NEG_INF;
        tile_max = fmaxf(tile_max, score[jr]);
    }
    const float m_new = fmaxf(*m, tile_max);
    const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;  // a row that saw nothing stays at zeros
    const float alpha = expf(*m - m_use);
    *m = m_new;
    float sum = 0.0f;
    unsigned short* p_row = (unsigned short*)(sh.s + r * W::S_LD);
#pragma unroll
    for (int jr = 0; jr < ATTN_KEYS; ++jr) {
        const float p = expf(score[jr] - m_use);
        sum += p;
        p_row[jr] = (unsigned short)float_to_half_bits(p);
    }
    *l = *l * alpha + sum;
    return alpha;
}

template <int D>
__device__ void attn_prefill_waves(ATTN_PREFILL_PARAMS) {
    typedef AttnWaves<D> W;
    __shared__ typename W::Shared sh;
    const int tid = threadIdx.x;
    const int wave = tid / MMA_WAVE;
    const int lane = tid % MMA_WAVE;
    const int head = blockIdx.y;
    const int g = head / (n_head / n_head_kv);
    const int first_token = blockIdx.x * ATTN_MMA_ROWS;
    const int wave_row = wave * W::BLOCKS * 16;  // the wave's first query row of the block
    if (tid < ATTN_MMA_ROWS) {
        attn_visible(positions, first_token + tid, n_tokens, kv_len, window, &sh.lo[tid], &sh.hi[tid]);
    }
    for (int i = tid; i < ATTN_MMA_ROWS * D / 2; i += ATTN_THREADS) {
        const int r = i / (D / 2);
        const int d = 2 * (i % (D / 2));
        const int t = first_token + r;
        attn_float2 v = {0.0f, 0.0f};
        if (t < n_tokens) {
            v = *(const attn_float2*)(q + ((long long)t * n_head + head) * D + d);
        }
        const unsigned int low = float_to_half_bits(v.x * scale);
        *(unsigned int*)(sh.q + r * W::LD + d) = low | (float_to_half_bits(v.y * scale) << 16);
    }
    __syncthreads();
    MmaA qa[W::BLOCKS][W::KS];
#pragma unroll
    for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
        for (int ks = 0; ks < W::KS; ++ks) {
            mma_load_a(qa[b][ks], sh.q + (wave_row + 16 * b) * W::LD + 16 * ks, lane, W::LD);
        }
    }
    int first = kv_len;
    int last = -1;
    int wave_first = kv_len;
    int wave_last = -1;
    for (int i = 0; i < ATTN_MMA_ROWS; ++i) {
        if (sh.lo[i] <= sh.hi[i]) {
            first = min(first, sh.lo[i]);
            last = max(last, sh.hi[i]);
            if (i >= wave_row && i < wave_row + W::BLOCKS * 16) {
                wave_first = min(wave_first, sh.lo[i]);
                wave_last = max(wave_last, sh.hi[i]);
            }
        }
    }
    const int j_start = first - first % ATTN_KEYS;
    const int n_tiles = last >= first ? (last - j_start) / ATTN_KEYS + 1 : 0;

    MmaAcc o[W::BLOCKS][W::KS];
#pragma unroll
    for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
        for (int dt = 0; dt < W::KS; ++dt) {
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) {
                o[b][dt].v[e] = 0.0f;
            }
        }
    }
    float m = ATTN_NEG_INF;  // the running max and sum of row tid (tid < ATTN_MMA_ROWS)
    float l = 0.0f;
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int j0 = j_start + tile * ATTN_KEYS;
        const bool wave_sees = j0 <= wave_last && j0 + ATTN_KEYS - 1 >= wave_first;  // the same for all its lanes
        __syncthreads();  // the last tile's step 4 is done with k, vt and P
        for (int i = tid; i < ATTN_KEYS * D / 8; i += ATTN_THREADS) {
            const int jr = i % ATTN_KEYS;  // consecutive threads, consecutive keys: V^T's stores spread over banks
            const int part = i / ATTN_KEYS;
            attn_words4 kw, vw;
            attn_cache_part<D>(k_cache, v_cache, n_head_kv, g, j0 + jr, part, first, last, &kw, &vw);
            *(attn_words4*)(sh.k + jr * W::LD + 8 * part) = kw;
            const unsigned int v_words[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                sh.vt[(8 * part + e) * W::VT_LD + jr] = (unsigned short)(v_words[e / 2] >> (16 * (e % 2)));
            }
        }
        __syncthreads();
        if (wave_sees) {
            MmaAcc s[W::BLOCKS][2];
#pragma unroll
            for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
                    for (int e = 0; e < MMA_ACC; ++e) {
                        s[b][nb].v[e] = 0.0f;
                    }
                }
            }
#pragma unroll
            for (int ks = 0; ks < W::KS; ++ks) {
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
                    MmaB kb;
                    mma_load_b(kb, sh.k + 16 * nb * W::LD + 16 * ks, lane, W::LD);
#pragma unroll
                    for (int b = 0; b < W::BLOCKS; ++b) {
                        mma_step_f16(s[b][nb], qa[b][ks], kb);
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
                    for (int e = 0; e < MMA_ACC; ++e) {
                        const int r = wave_row + 16 * b + mma_row(lane, e);
                        sh.s[r * W::S_LD + 16 * nb + mma_col(lane, e)] = s[b][nb].v[e];
                    }
                }
            }
        }
        __syncthreads();
        if (tid < ATTN_MMA_ROWS) {
            sh.alpha[tid] = attn_waves_row_update<D>(sh, tid, j0, &m, &l);
        }
        __syncthreads();
        if (wave_sees) {
#pragma unroll
            for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
                for (int dt = 0; dt < W::KS; ++dt) {
#pragma unroll
                    for (int e = 0; e < MMA_ACC; ++e) {
                        o[b][dt].v[e] *= sh.alpha[wave_row + 16 * b + mma_row(lane, e)];
                    }
                }
            }
            const unsigned short* p = (const unsigned short*)sh.s;
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
                MmaA pa[W::BLOCKS];
#pragma unroll
                for (int b = 0; b < W::BLOCKS; ++b) {
                    mma_load_a(pa[b], p + (wave_row + 16 * b) * W::P_LD + 16 * kc, lane, W::P_LD);
                }
#pragma unroll
                for (int dt = 0; dt < W::KS; ++dt) {
                    MmaB vb;
                    mma_load_b(vb, sh.vt + 16 * dt * W::VT_LD + 16 * kc, lane, W::VT_LD);
#pragma unroll
                    for (int b = 0; b < W::BLOCKS; ++b) {
                        mma_step_f16(o[b][dt], pa[b], vb);
                    }
                }
            }
        }
    }
    if (tid < ATTN_MMA_ROWS) {
        const float keep = sinks ? attn_join_sink(m, &l, sinks[head]) : 1.0f;
        sh.inv[tid] = l > 0.0f ? keep / l : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < W::BLOCKS; ++b) {
#pragma unroll
        for (int e = 0; e < MMA_ACC; ++e) {
            const int r = wave_row + 16 * b + mma_row(lane, e);
            const int t = first_token + r;
            if (t < n_tokens) {
                float* out_row = out + ((long long)t * n_head + head) * D;
#pragma unroll
                for (int dt = 0; dt < W::KS; ++dt) {
                    out_row[16 * dt + mma_col(lane, e)] = o[b][dt].v[e] * sh.inv[r];
                }
            }
        }
    }
}

#endif  // ATTN_MMA_NVIDIA

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prefill_mma_d64(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
#if defined(ATTN_MMA_NVIDIA)
    attn_prefill_mma<64, ATTN_MMA_ROWS / 16>(ATTN_PREFILL_ARGS);
#else
    attn_prefill_waves<64>(ATTN_PREFILL_ARGS);
#endif
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prefill_mma_d128(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
#if defined(ATTN_MMA_NVIDIA)
    attn_prefill_mma<128, ATTN_MMA_ROWS / 16>(ATTN_PREFILL_ARGS);
#else
    attn_prefill_waves<128>(ATTN_PREFILL_ARGS);
#endif
}

#if defined(ATTN_MMA_NVIDIA)
// attn_prefill_mma_d* with 8 warps, 128 queries a block: each staged key and value tile serves twice the
// queries (half the cache reads) at the same registers a thread, one block a multiprocessor where the
// 64-query kernel fits three. Faster for heads 128 wide, slower for 64 (docs/results/attention-h100.md).
extern "C" __global__ void __launch_bounds__(256) attn_prefill_mma128_d64(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_prefill_mma<64, 8>(ATTN_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(256) attn_prefill_mma128_d128(ATTN_PREFILL_PARAMS) {
    KERNEL_PROLOGUE();
    attn_prefill_mma<128, 8>(ATTN_PREFILL_ARGS);
}
#endif

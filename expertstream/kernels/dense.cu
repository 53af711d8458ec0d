// ---------------------------------------------------------------------------------
// The dense pieces of a transformer forward pass (kernels/dense.py): table rows decoded to
// float32 (token embeddings), the RMS norm with an optional weight, bias rows, the rotary
// position embedding of ggml's rope_ext (YaRN included) and the float16 KV cache write.
// Compiled after every other file; the per-type get_rows kernels are DENSE_GET_ROWS
// instances, appended for the types a module needs (program.py).
// ---------------------------------------------------------------------------------

#define GET_ROWS_THREADS 128
#define GET_ROWS_CHUNK (GET_ROWS_THREADS * 32)  // row elements per block: one 32-element slice per thread
#define DENSE_NORM_MAX_THREADS 256              // the norm's sum: a power of two of lanes up to this
#define DENSE_NORM_BLOCK_THREADS 1024           // the norm kernels' blocks: at most this many threads
#define DENSE_THREADS 256                       // add_rows, rope, store_rows_f16

// float32 to float16 bits, rounded to nearest even: overflow to infinity, subnormal halves
// included, NaN stays a (quiet) NaN of the same sign.
__device__ unsigned int float_to_half_bits(float f) {
    const unsigned int bits = float_to_bits(f);
    const unsigned int sign = (bits >> 16) & 0x8000u;
    const unsigned int magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) {
        return sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    }
    if (magnitude >= 0x477ff000u) {  // 65520 and up: halfway past the largest half (65504) rounds to even, up
        return sign | 0x7c00u;
    }
    if (magnitude < 0x38800000u) {
        // Below 2^-14 the half is subnormal, in units of 2^-24: adding 0.5 puts that unit in the
        // last mantissa bit of the float sum, whose rounding is nearest even.
        const float shifted = bits_to_float(magnitude) + 0.5f;
        return sign | (float_to_bits(shifted) - 0x3f000000u);
    }
    // Rebase the exponent (127 - 15 = 112), round the 13 dropped bits to nearest even; a
    // carry out of the mantissa moves into the exponent, as it should.
    const unsigned int rebased = magnitude - 0x38000000u;
    return sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
}

// Element j of a float table row (F32, F16, BF16). The quantized types decode whole slices
// instead and never call it.
template <int TYPE>
__device__ float table_element(const typename BlockFormat<TYPE>::Unit*, int) {
    return bits_to_float(0x7fc00000u);
}

template <> __device__ float table_element<ES_TYPE_F32>(const unsigned int* row, int j) {
    return bits_to_float(row[j]);
}

template <> __device__ float table_element<ES_TYPE_F16>(const unsigned short* row, int j) {
    return half_to_float(row[j]);
}

template <> __device__ float table_element<ES_TYPE_BF16>(const unsigned short* row, int j) {
    return bf16_to_float(row[j]);
}

// out[i, c0 .. c0 + GET_ROWS_CHUNK) = row ids[i] of the table, for c0 = blockIdx.x * GET_ROWS_CHUNK
// and the rows i = blockIdx.y, blockIdx.y + gridDim.y, ... An id outside [0, n_table_rows) gives
// NaN and reads nothing. Quantized rows: each thread decodes one 32-element slice into shared
// memory (its block's units staged as the matrix kernels stage them), then the block writes the
// chunk out contiguously. Float rows: one element per thread and step, read and written in order.
template <int TYPE>
__device__ void get_rows_chunk(const unsigned char* __restrict__ table, const int* __restrict__ ids,
                               float* __restrict__ out, int n_cols, int n_table_rows, int n_ids) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    __shared__ float decoded[GET_ROWS_THREADS][33];  // odd row stride: the write-out reads without bank conflicts

    const int tid = threadIdx.x;
    const int c0 = blockIdx.x * GET_ROWS_CHUNK;
    const int c_end = min(n_cols, c0 + GET_ROWS_CHUNK);
    const long long row_bytes = weight_row_bytes<TYPE>(n_cols);
    for (int i = blockIdx.y; i < n_ids; i += gridDim.y) {
        const int r = ids[i];
        float* dst = out + (long long)i * n_cols;
        if (r < 0 || r >= n_table_rows) {  // the same r for the whole block: it skips the barriers together
            for (int c = c0 + tid; c < c_end; c += GET_ROWS_THREADS) {
                dst[c] = bits_to_float(0x7fc00000u);
            }
            continue;
        }
        const unsigned char* row = table + (long long)r * row_bytes;
        if (!BlockFormat<TYPE>::quantized) {
            for (int c = c0 + tid; c < c_end; c += GET_ROWS_THREADS) {
                dst[c] = table_element<TYPE>((const Unit*)row, c);
            }
            continue;
        }
        const int slice = c0 / 32 + tid;
        if (slice * 32 < n_cols) {
            const Unit* block = (const Unit*)(row + (long long)(slice / SLICES) * BlockFormat<TYPE>::bytes);
            Unit staged[UNITS];
#pragma unroll
            for (int h = 0; h < UNITS; ++h) {
                staged[h] = block[BlockFormat<TYPE>::unit_of(slice % SLICES, h)];
            }
            decode_slice<TYPE>(staged, slice % SLICES, decoded[tid]);
        }
        __syncthreads();
        for (int j = tid; j < c_end - c0; j += GET_ROWS_THREADS) {
            dst[c0 + j] = decoded[j / 32][j % 32];
        }
        __syncthreads();  // the next row's decode overwrites the tile
    }
}

// One get_rows kernel per table type, named by layout.WeightFormat.get_rows_kernel_name.
#define DENSE_GET_ROWS(NAME, TYPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(GET_ROWS_THREADS)                                 \
        NAME(const unsigned char* __restrict__ table, const int* __restrict__ ids,                \
             float* __restrict__ out, int n_cols, int n_table_rows, int n_ids) {                 \
        KERNEL_PROLOGUE();                                                                       \
        get_rows_chunk<TYPE>(table, ids, out, n_cols, n_table_rows, n_ids);                       \
    }

// The lanes of a norm over rows of n elements: the power of two that covers n, from 32 up to
// DENSE_NORM_MAX_THREADS (dense.norm_threads). The block may have more threads (their loads in flight
// together) or fewer; the sum's order is this one.
__device__ int norm_lanes(int n) {
    int lanes = 32;
    while (lanes < n && lanes < DENSE_NORM_MAX_THREADS) {
        lanes *= 2;
    }
    return lanes;
}

// 1 / sqrt(mean(row^2) + eps), the sum taken over norm_lanes(n) logical threads: lane l adds the
// squares of elements l, l + lanes, ... in order, then the lanes' sums meet in a fixed tree. Thread t
// plays lanes t, t + blockDim.x, ... (those under the lanes), so the result depends on n alone, not on
// the block size. Every thread of the block calls it (it holds barriers); it opens with one, since the
// row may have just been written by other threads of the block.
__device__ float rms_scale(const float* row, int n, float eps, float* partial) {
    const int tid = threadIdx.x;
    const int lanes = norm_lanes(n);
    __syncthreads();
    for (int lane = tid; lane < lanes; lane += blockDim.x) {
        float sum = 0.0f;
#pragma unroll 8  // the loads of several elements in flight; the sum stays in order
        for (int i = lane; i < n; i += lanes) {
            sum = fmaf(row[i], row[i], sum);
        }
        partial[lane] = sum;
    }
    __syncthreads();
    for (int s = lanes / 2; s > 0; s >>= 1) {
        for (int lane = tid; lane < s; lane += blockDim.x) {
            partial[lane] += partial[lane + s];
        }
        __syncthreads();
    }
    const float scale = 1.0f / sqrtf(partial[0] / (float)n + eps);
    __syncthreads();  // partial[0] is read by every thread before the next call writes partial
    return scale;
}

// dst[i] = row[i] * scale (* weight[i] where weight is not null) for the thread's elements i = tid,
// tid + blockDim.x, ...: rms_scale's row normed.
__device__ void rms_store(const float* row, int n, float scale, const float* __restrict__ weight, float* dst) {
#pragma unroll 8
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = row[i] * scale;
        dst[i] = weight ? v * weight[i] : v;
    }
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) (* weight[:] where weight is not null), as
// ggml's rms_norm followed by its mul. One block per row of up to DENSE_NORM_BLOCK_THREADS threads
// (dense.norm_block); the sum of squares is reduced in rms_scale's fixed order. out may be x: the
// writes come after the reduction's barriers, each element written by the thread that reads it then.
extern "C" __global__ void __launch_bounds__(DENSE_NORM_BLOCK_THREADS)
    dense_rms_norm(const float* x, const float* __restrict__ weight, float* out, int n_rows, int n, float eps) {
    KERNEL_PROLOGUE();
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    const int r = blockIdx.x;
    if (r >= n_rows) {
        return;  // the whole block returns: no thread is left waiting at a barrier
    }
    const float* row = x + (long long)r * n;
    rms_store(row, n, rms_scale(row, n, eps, partial), weight, out + (long long)r * n);
}

// hidden[r, :] += delta[r, :], then out[r, :] = the new row's rms_norm (times weight[:] where not
// null): moe_add_inplace followed by dense_rms_norm in one launch, the same float operations (the
// sum's barrier comes after the adds). out must not overlap hidden.
extern "C" __global__ void __launch_bounds__(DENSE_NORM_BLOCK_THREADS)
    dense_add_rms_norm(float* __restrict__ hidden, const float* __restrict__ delta, const float* __restrict__ weight,
                       float* __restrict__ out, int n_rows, int n, float eps) {
    KERNEL_PROLOGUE();
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    const int r = blockIdx.x;
    if (r >= n_rows) {
        return;  // the whole block returns: no thread is left waiting at a barrier
    }
    const int tid = threadIdx.x;
    float* row = hidden + (long long)r * n;
    const float* add = delta + (long long)r * n;
#pragma unroll 8
    for (int i = tid; i < n; i += blockDim.x) {
        row[i] += add[i];
    }
    rms_store(row, n, rms_scale(row, n, eps, partial), weight, out + (long long)r * n);
}

// mul_mat_vec_add_norm: decode's attention output projection, its residual add and the FFN's norm in
// one launch: y[t] = W x[t] for a few tokens (a matrix-vector launch of one expert, the rows as
// mul_mat_vec_id sums them; grid (ceil(n / MOE_GEMV_ROWS), n_tokens)), then the last of token t's blocks to
// finish (counters[t], wrapped back to 0 by atomicInc) adds y[t] into hidden[t] and writes out[t] = its
// rms_norm times weight, as dense_add_rms_norm does (rms_scale's lanes, played by this launch's
// threads): the bytes of the three launches. y, hidden and out are [n_tokens, n].
template <int TYPE>
__device__ void mul_mat_vec_add_norm(const unsigned char* __restrict__ w, const float* __restrict__ x, float* y,
                                     float* __restrict__ hidden, const float* __restrict__ weight,
                                     float* __restrict__ out, unsigned int* counters, int n, int n_in, float eps) {
    __shared__ int last;
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    const int token = blockIdx.y;
    gemv_block_rows<TYPE>(w, x + (long long)token * n_in, y + (long long)token * n, n, n_in);
    __threadfence();  // this thread's rows are visible to every block before the block counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(counters + token, gridDim.x - 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;  // the whole block returns together
    }
    __threadfence();
    const volatile float* add = y + (long long)token * n;  // other blocks of this launch wrote it
    float* row = hidden + (long long)token * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        row[i] += add[i];
    }
    rms_store(row, n, rms_scale(row, n, eps, partial), weight, out + (long long)token * n);
}

// One mul_mat_vec_add_norm kernel per weight type, named by layout.WeightFormat.gemv_add_norm_kernel_name.
#define DENSE_MUL_MAT_VEC_ADD_NORM(NAME, TYPE)                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))    \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x, float* y,            \
             float* __restrict__ hidden, const float* __restrict__ weight, float* __restrict__ out, \
             unsigned int* counters, int n, int n_in, float eps) {                                  \
        KERNEL_PROLOGUE();                                                                          \
        mul_mat_vec_add_norm<TYPE>(w, x, y, hidden, weight, out, counters, n, n_in, eps);           \
    }

// hidden[t, :] += the MoE layer's combine_sum (elementwise.cu), then out[t, :] = the new row's rms_norm
// (times weight[:] where not null): moe_combine followed by dense_rms_norm in one launch, the same float
// operations (decode: the next layer's attention norm, or the output norm, in the layer's last launch).
// One block per token, of dense_rms_norm's size for n. out must not overlap hidden, y or extra.
extern "C" __global__ void __launch_bounds__(DENSE_NORM_BLOCK_THREADS)
    dense_combine_rms_norm(const float* __restrict__ y, const float* __restrict__ weights,
                           const float* __restrict__ extra, float* __restrict__ hidden,
                           const float* __restrict__ weight, float* __restrict__ out, int n_tokens, int top_k, int n,
                           float eps) {
    KERNEL_PROLOGUE();
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;  // the whole block returns: no thread is left waiting at a barrier
    }
    float* row = hidden + (long long)t * n;
#pragma unroll 8  // one block for the whole row: several elements' loads in flight a thread
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        row[i] += combine_sum<const float* __restrict__>(y, weights, extra, t, i, top_k, n);
    }
    rms_store(row, n, rms_scale(row, n, eps, partial), weight, out + (long long)t * n);
}

// mul_mat_vec_combine_norm: decode's down projection, the MoE layer's combine and the next norm in one
// launch. y[p] = W[ids[p]] act[p] for each (token, k) pair p, the rows as mul_mat_vec_id sums and scales
// them (route_weights where not null; grid (ceil(n / MOE_GEMV_ROWS), n_tokens * top_k)); then the last of
// token t's blocks to finish (counters[t], wrapped back to 0 by atomicInc) does dense_combine_rms_norm's
// work for t: hidden[t] += combine_sum(y, weights, extra, t, ...), out[t] = the new row's rms_norm times
// weight (rms_scale's lanes, played by this launch's threads). The bytes of the down launch followed by
// the combine's. y, extra, hidden and out are apart.
template <int TYPE>
__device__ void mul_mat_vec_combine_norm(const unsigned char* __restrict__ w, const float* __restrict__ act,
                                         const int* __restrict__ ids, float* y, const float* __restrict__ route_weights,
                                         const float* __restrict__ weights, const float* __restrict__ extra,
                                         float* __restrict__ hidden, const float* __restrict__ weight,
                                         float* __restrict__ out, unsigned int* counters, int n_expert, int n,
                                         int n_in, int top_k, float eps) {
    __shared__ int last;
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    mul_mat_vec_id<TYPE>(w, act, ids, y, n_expert, n, n_in, top_k, 1, gridDim.y, route_weights, 0);
    __threadfence();  // this thread's rows are visible to every block before the block counts itself
    __syncthreads();
    const int token = blockIdx.y / top_k;
    const unsigned int blocks = gridDim.x * top_k;  // token t's: every row block of its top_k pairs
    if (threadIdx.x == 0) {
        last = atomicInc(counters + token, blocks - 1) == blocks - 1;
    }
    __syncthreads();
    if (!last) {
        return;  // the whole block returns together
    }
    __threadfence();
    float* row = hidden + (long long)token * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {  // other blocks of this launch wrote y
        row[i] += combine_sum<const volatile float*>(y, weights, extra, token, i, top_k, n);
    }
    rms_store(row, n, rms_scale(row, n, eps, partial), weight, out + (long long)token * n);
}

// One mul_mat_vec_combine_norm kernel per weight type, named by layout.WeightFormat.gemv_combine_norm_kernel_name.
#define DENSE_MUL_MAT_VEC_COMBINE_NORM(NAME, TYPE)                                                            \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))              \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ act, const int* __restrict__ ids, \
             float* y, const float* __restrict__ route_weights, const float* __restrict__ weights,            \
             const float* __restrict__ extra, float* __restrict__ hidden, const float* __restrict__ weight,   \
             float* __restrict__ out, unsigned int* counters, int n_expert, int n, int n_in, int top_k,       \
             float eps) {                                                                                     \
        KERNEL_PROLOGUE();                                                                                    \
        mul_mat_vec_combine_norm<TYPE>(w, act, ids, y, route_weights, weights, extra, hidden, weight, out,    \
                                       counters, n_expert, n, n_in, top_k, eps);                              \
    }

// y[r, i] += bias[i]: thread i of the row block, rows blockIdx.y, blockIdx.y + gridDim.y, ...
extern "C" __global__ void dense_add_rows(float* __restrict__ y, const float* __restrict__ bias, int n_rows, int n) {
    KERNEL_PROLOGUE();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float b = bias[i];
    for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        y[(long long)r * n + i] += b;
    }
}

// Rotary position embedding in place on x [n_tokens, n_heads, head_dim], ggml's rope_ext: pair
// i < n_rot / 2 of a head is (2i, 2i + 1), or (i, i + n_rot / 2) in NEOX mode, rotated by
//   theta_extrap = pos * freq_base^(-2i / n_rot), theta_interp = freq_scale * theta_extrap,
//   theta = theta_interp, or with ext_factor != 0 (YaRN) the mix
//   theta_interp * (1 - m) + theta_extrap * m, m = ext_factor * (1 - clamp((i - corr_low) /
//   max(0.001, corr_high - corr_low), 0, 1)),
// with cos and sin scaled by mscale (attn_factor, times 1 + 0.1 ln(1 / freq_scale) under YaRN;
// the launcher computes it and the correction dims). Dimensions from n_rot on pass through.
// Thread p of the token's block row takes pair p % (n_rot / 2) of head p / (n_rot / 2); tokens
// blockIdx.y, blockIdx.y + gridDim.y, ...
struct RopeArgs {
    int n_rot, neox;
    float freq_base, freq_scale, ext_factor, corr_low, corr_high, mscale;
};

// Pair i's cos and sin (mscale included) at position pos, as dense_rope's comment says.
__device__ void rope_cos_sin(const RopeArgs& r, int i, int pos, float* c, float* s) {
    const float inv_freq = powf(r.freq_base, -(float)(2 * i) / (float)r.n_rot);
    float ramp_mix = 0.0f;
    if (r.ext_factor != 0.0f) {
        const float y = ((float)i - r.corr_low) / fmaxf(0.001f, r.corr_high - r.corr_low);
        ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * r.ext_factor;
    }
    const float theta_extrap = (float)pos * inv_freq;
    const float theta_interp = r.freq_scale * theta_extrap;
    const float theta =
        r.ext_factor != 0.0f ? fmaf(theta_extrap, ramp_mix, theta_interp * (1.0f - ramp_mix)) : theta_interp;
    *c = cosf(theta) * r.mscale;
    *s = sinf(theta) * r.mscale;
}

extern "C" __global__ void dense_rope(float* __restrict__ x, const int* __restrict__ positions, int n_tokens,
                                      int n_heads, int head_dim, int n_rot, int neox, float freq_base,
                                      float freq_scale, float ext_factor, float corr_low, float corr_high,
                                      float mscale) {
    KERNEL_PROLOGUE();
    const RopeArgs rope = {n_rot, neox, freq_base, freq_scale, ext_factor, corr_low, corr_high, mscale};
    const int half = n_rot / 2;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n_heads * half) {
        return;
    }
    const int head = p / half;
    const int i = p % half;
    const int first = neox ? i : 2 * i;
    const int second = neox ? i + half : 2 * i + 1;
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        float c, s;
        rope_cos_sin(rope, i, positions[t], &c, &s);
        float* head_x = x + ((long long)t * n_heads + head) * head_dim;
        const float x0 = head_x[first];
        const float x1 = head_x[second];
        head_x[first] = fmaf(x0, c, -(x1 * s));
        head_x[second] = fmaf(x0, s, x1 * c);
    }
}

// cache[positions[t], j] = src[t, j] as float16 (nearest even) for j < width: thread j of the row
// block, tokens blockIdx.y, blockIdx.y + gridDim.y, ... A position outside [0, n_cache_rows)
// writes nothing.
extern "C" __global__ void dense_store_rows_f16(const float* __restrict__ src, unsigned short* __restrict__ cache,
                                                const int* __restrict__ positions, int n_tokens, int width,
                                                int n_cache_rows) {
    KERNEL_PROLOGUE();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) {
        return;
    }
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const int row = positions[t];
        if (row >= 0 && row < n_cache_rows) {
            cache[(long long)row * width + j] = (unsigned short)float_to_half_bits(src[(long long)t * width + j]);
        }
    }
}

// What attention needs of a token's projected q, k and v rows, in one launch: each head row of q
// and k normed by its own RMS (with the layer's q_norm / k_norm weight, where not null) and
// rotated, q in place; k and v rounded to float16 into their caches at positions[t] (a position
// outside [0, n_cache_rows) writes nothing). The same float operations, in the same order, as
// dense_rms_norm (its block size for head_dim), dense_rope and dense_store_rows_f16 one after
// another, so the bytes are theirs. Block x: q heads, then k heads, then v heads; tokens
// blockIdx.y, blockIdx.y + gridDim.y, ...; blockDim.x is rms_norm's for head_dim (>= head_dim).
extern "C" __global__ void __launch_bounds__(DENSE_NORM_MAX_THREADS)
    dense_qkv_rope_store(float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                         unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache,
                         const int* __restrict__ positions, int n_tokens, int n_head, int n_head_kv, int head_dim,
                         int n_cache_rows, float eps, int n_rot, int neox, float freq_base, float freq_scale,
                         float ext_factor, float corr_low, float corr_high, float mscale) {
    KERNEL_PROLOGUE();
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    __shared__ float normed[DENSE_NORM_MAX_THREADS];
    const RopeArgs rope = {n_rot, neox, freq_base, freq_scale, ext_factor, corr_low, corr_high, mscale};
    const int tid = threadIdx.x;
    const int head = blockIdx.x;
    const bool is_q = head < n_head;
    const bool is_v = head >= n_head + n_head_kv;
    const int kv_head = is_q ? 0 : is_v ? head - n_head - n_head_kv : head - n_head;
    const float* weight = is_q ? q_norm : is_v ? 0 : k_norm;
    const int half = n_rot / 2;
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const float* src = is_q ? q + ((long long)t * n_head + head) * head_dim
                                : (is_v ? v : k) + ((long long)t * n_head_kv + kv_head) * head_dim;
        float x = tid < head_dim ? src[tid] : 0.0f;
        if (weight) {  // the same for the whole block: every thread meets the barriers
            const float scale = rms_scale(src, head_dim, eps, partial);
            x = tid < head_dim ? x * scale * weight[tid] : 0.0f;
        }
        if (!is_v) {
            normed[tid] = x;
            __syncthreads();
            if (tid < 2 * half) {  // a rotated dimension: the pair's two outputs, this thread's one kept
                const int i = neox ? tid % half : tid / 2;
                const bool second = neox ? tid >= half : tid % 2 == 1;
                const float x0 = normed[neox ? i : 2 * i];
                const float x1 = normed[neox ? i + half : 2 * i + 1];
                float c, s;
                rope_cos_sin(rope, i, positions[t], &c, &s);
                x = second ? fmaf(x0, s, x1 * c) : fmaf(x0, c, -(x1 * s));
            }
            __syncthreads();  // the next token's rows overwrite normed
        }
        if (tid < head_dim) {
            if (is_q) {
                q[((long long)t * n_head + head) * head_dim + tid] = x;
            } else {
                const int row = positions[t];
                if (row >= 0 && row < n_cache_rows) {
                    unsigned short* cache = is_v ? v_cache : k_cache;
                    cache[((long long)row * n_head_kv + kv_head) * head_dim + tid] = (unsigned short)float_to_half_bits(x);
                }
            }
        }
    }
}

// dst[r, j] = src[r, first + j] for j < width: columns of rows src_width wide taken out into rows of
// their own (deepseek2's query parts and each head's latent output). Thread j of the row block,
// rows blockIdx.y, blockIdx.y + gridDim.y, ...
extern "C" __global__ void dense_copy_columns(const float* __restrict__ src, float* __restrict__ dst, int n_rows,
                                              int src_width, int first, int width) {
    KERNEL_PROLOGUE();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) {
        return;
    }
    for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        dst[(long long)r * width + j] = src[(long long)r * src_width + first + j];
    }
}

// deepseek2's latent attention inputs for a token batch, in one launch. Block h < n_head of token t
// writes head h's query as attention reads it into q_out [n_tokens, n_head, rank + n_rot]: its
// query absorbed into the latent, q_abs[t, h, :rank], then the rotated part of its projected query
// q[t, h, nope:] (q rows nope + n_rot wide) rotated. Block n_head writes the shared key row into the
// float16 cache at positions[t] (outside [0, n_cache_rows): nothing): the latent kv[t, :rank]
// over its RMS (times kv_norm where not null, as rms_store), then kv[t, rank:] rotated. Rotation
// and rounding as dense_rope and dense_store_rows_f16. Tokens blockIdx.y, blockIdx.y + gridDim.y, ...
extern "C" __global__ void __launch_bounds__(DENSE_NORM_MAX_THREADS)
    dense_mla_rope_store(const float* __restrict__ q, const float* __restrict__ q_abs, const float* __restrict__ kv,
                         const float* __restrict__ kv_norm, float* __restrict__ q_out,
                         unsigned short* __restrict__ cache, const int* __restrict__ positions, int n_tokens,
                         int n_head, int rank, int nope, int n_cache_rows, float eps, int n_rot, int neox,
                         float freq_base, float freq_scale, float ext_factor, float corr_low, float corr_high,
                         float mscale) {
    KERNEL_PROLOGUE();
    __shared__ float partial[DENSE_NORM_MAX_THREADS];
    const RopeArgs rope = {n_rot, neox, freq_base, freq_scale, ext_factor, corr_low, corr_high, mscale};
    const int head = blockIdx.x;
    const bool is_k = head == n_head;  // the same for the whole block: every thread meets the barriers
    const int half = n_rot / 2;
    const int width = rank + n_rot;
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const float* kv_row = kv + (long long)t * width;
        const float scale = is_k ? rms_scale(kv_row, rank, eps, partial) : 1.0f;
        const float* rotated = is_k ? kv_row + rank : q + ((long long)t * n_head + head) * (nope + n_rot) + nope;
        const int pos = positions[t];
        const int row = is_k ? pos : 0;
        if (is_k && (row < 0 || row >= n_cache_rows)) {
            continue;  // after the norm's barriers, as every thread of the block
        }
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            float x;
            if (i < rank) {
                if (is_k) {
                    const float v = kv_row[i] * scale;
                    x = kv_norm ? v * kv_norm[i] : v;
                } else {
                    x = q_abs[((long long)t * n_head + head) * rank + i];
                }
            } else {
                const int d = i - rank;
                const int p = neox ? d % half : d / 2;
                const bool second = neox ? d >= half : d % 2 == 1;
                const float x0 = rotated[neox ? p : 2 * p];
                const float x1 = rotated[neox ? p + half : 2 * p + 1];
                float c, s;
                rope_cos_sin(rope, p, pos, &c, &s);
                x = second ? fmaf(x0, s, x1 * c) : fmaf(x0, c, -(x1 * s));
            }
            if (is_k) {
                cache[(long long)row * width + i] = (unsigned short)float_to_half_bits(x);
            } else {
                q_out[((long long)t * n_head + head) * width + i] = x;
            }
        }
    }
}

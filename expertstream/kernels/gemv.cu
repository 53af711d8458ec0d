// ---------------------------------------------------------------------------------
// mul_mat_vec_id: mul_mat_id for a few (token, k) pairs, as decode runs it.
//
// The tile kernels give a block 128 output rows of one expert, so one token's top-k pairs
// (or a dense projection run as one expert and one pair) make only n_out / 128 blocks per
// expert: far too few to read the weights at the memory's bandwidth. Here a logical wave of
// MOE_GEMV_WAVE threads computes MOE_GEMV_WAVE_ROWS output rows of one pair side by side, and a
// block MOE_GEMV_ROWS rows of one pair: grid (ceil(n_out / MOE_GEMV_ROWS), n_pairs), no grouping pass.
// gate_up_vec_id (below) puts a gate row and an up row side by side instead; mul_mat_vec_parts runs up
// to three dense projections of the same activations (attention's Q, K, V) in one launch.
//
// The block stages its pair's activation row in shared memory (float rows of up to MOE_GEMV_STAGE
// elements, each slice padded to MOE_GEMV_STAGE_LD floats so the lanes, each on a slice of its own,
// read it conflict-free; longer float rows are read from global memory; int8 rows in chunks of
// MOE_GEMV_STAGE_Q8 elements); each slice a lane reads serves all its wave's rows. Each lane has GemvX<TYPE>::DEPTH
// slices of each row in flight, the first ones issued before the staging, so both wait on memory
// together.
//
// Lane l of a wave takes the row's 32-element slices l, l + 32, ...: it loads a slice's units
// (16 bytes at a time where the type's slice is made of 16-byte runs and the address allows) and
// adds the slice's product in ascending slice order: for most types decoded by decode_slice and
// summed as x * w in float32, for the types of GemvInt8 (Q4_0, Q4_K, Q6_K, Q8_0, MXFP4) as the
// integer dot of the weight quants with the activations on the int8 grid, scaled in float32 (GemvX
// below). The wave's 32 partial sums are then added in a fixed tree (lane l + s into
// lane l for s = 16, 8, 4, 2, 1), so an output does not depend on timing, on the other pairs of
// the call or on the wave size of the device: on NVIDIA through warp shuffles, elsewhere (AMD's
// wave64 targets, the host test harness) through shared memory and barriers, the same
// additions in the same order.
//
// The tensor's last row is read, as the tile kernels read every row, up to the next multiple of
// MOE_ROW_PADDING elements against zero activations (ggml's padding tail): a dirty tail shows as
// NaN. Other rows stop at n_in: past them lie the next row's elements, which add only zeros.
// Pairs whose id is outside [0, n_expert) get NaN rows and read no weights.
// With route_weights (float32 per pair; null for none) each row is scaled by its pair's routing
// weight, as the direct kernels' down projection does: y = route_weights[p] * (W x). With silu_gate
// (float32 [pairs, n_out]; null for none) the output is SwiGLU's of that gate and this product,
// y = silu(g) * (W x) with moe_swiglu's float operations: up and SwiGLU in one launch.
// ---------------------------------------------------------------------------------

// Must match expertstream/kernels/layout.py.
// 8 waves a block: the activation row quantized once for 16 output rows (with the 64-register bound below,
// an H100's 8-pair expert launches ran 11-19% faster than in 128-thread blocks: decode-kernels-h100.md)
#define MOE_GEMV_THREADS 256
#define MOE_GEMV_WAVE 32     // lanes per output row: a logical wave
#define MOE_GEMV_WAVE_ROWS 2 // output rows per wave, side by side: an activation slice is read once for all
#define MOE_GEMV_BLOCK_ROWS(WR) (MOE_GEMV_THREADS / MOE_GEMV_WAVE * (WR))  // output rows per block at WR a wave
#define MOE_GEMV_ROWS MOE_GEMV_BLOCK_ROWS(MOE_GEMV_WAVE_ROWS)                 // output rows per block
static_assert(MOE_GEMV_WAVE == 32, "a row's lanes add up by wave32_sum");
#define MOE_GEMV_STAGE 4096  // activation rows up to this many elements are staged in shared memory
#define MOE_GEMV_STAGE_LD 33 // floats per staged 32-element slice: lane l's slice l starts in bank l
#define MOE_GEMV_DEPTH 1     // slices of each of a wave's rows a lane has in flight (2: decode 8% slower on
                             // an H100, Q4_K's registers 90 to 120 a thread; docs/results/decode-round5.md)
// Blocks a multiprocessor must hold at once, on NVIDIA, for the types whose rows meet int8 activations
// (GemvInt8): 64 registers a thread, 32 warps (no bound: 70-94 registers, 16-24 warps;
// decode-kernels-h100.md). The float path's 32 decoded floats a slice would spill at 64 registers: no
// bound there. On AMD the second bound means waves per execution unit, which some of these kernels'
// registers miss at 4: none asked.
#if defined(__CUDA_ARCH__)
#define MOE_GEMV_MIN_BLOCKS 4
#else
#define MOE_GEMV_MIN_BLOCKS 1
#endif
#define MOE_GEMV_MIN_BLOCKS_OF(TYPE) (GemvInt8<TYPE>::value ? MOE_GEMV_MIN_BLOCKS : 1)

// NVIDIA's warp-shuffle paths of this file beyond wave32_sum (the activations' amax), and the host test
// harness's emulation of them (ES_EMULATE_WARPS): the bytes of the shared-memory paths they stand for.
#if defined(__CUDA_ARCH__) || defined(ES_EMULATE_WARPS)
#define GEMV_WARP_PATHS 1
#endif

// The sum of the partial sums of a logical wave of 32 threads, valid at its lane 0 (the matrix-vector
// kernels' rows here, the router's logits in routing.cu): lane l + s added into lane l for s = 16, 8,
// 4, 2, 1, the same additions on every device. Every thread of the block calls it: on NVIDIA through
// warp shuffles; elsewhere (AMD's wave64 targets, the host harness) through ``exchange`` (a float per
// thread of the block) and barriers, the first of which lets an earlier call's readers finish.
__device__ float wave32_sum(float partial, float* exchange) {
#if defined(__CUDA_ARCH__)
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        partial += __shfl_down_sync(0xffffffffu, partial, s);
    }
    return partial;
#else
    const int tid = threadIdx.x;
    __syncthreads();
    exchange[tid] = partial;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (tid % 32 < s) {
            exchange[tid] += exchange[tid + s];
        }
        __syncthreads();
    }
    return exchange[tid];
#endif
}

struct alignas(16) gemv_words4 {
    unsigned int x, y, z, w;
};

// ---------------------------------------------------------------------------------
// Activations on the int8 grid, as the int8 path (int8.cu's moe_quantize_x) and llama.cpp's q8_1
// matrix-vector products take them: per 32-element block d = amax / 127, and with r = 127 / amax,
// q = the integer nearest x * r (ties to even, the product unrounded: one fmaf), s = d * sum(q), all
// in float32. |x * r| stays within 127 + 2^-16, so q needs no clamp. A block holding a NaN or an
// infinity gets d = s = NaN and q = 0; an all-zero block, or one whose r overflows (amax below
// 127 / FLT_MAX, about 3.7e-37), d = amax / 127, q = 0 and s = 0. No division by element: the
// matrix-vector kernels quantize their row in every block.
// ---------------------------------------------------------------------------------

struct alignas(8) Int8Scales {
    float d;  // activations: the block's scale; weights: the multiplier of the integer dot
    float s;  // activations: d * sum(q); weights: what multiplies it (Q4_K: dmin * m), else 0
};

#define QUANT_ROUND_BIAS 12582912.0f  // 1.5 * 2^23: added to |v| < 2^22, it leaves rint(v) in the low bits

// c + the dot product of the four signed bytes of a with those of b (exact in int32): one instruction
// on NVIDIA from sm_61 and on the AMD targets tests/amdcompile checks (v_dot4c_i32_i8 on gfx90a, gfx942
// and gfx1030; v_dot4_i32_iu8 with both operands signed on gfx1100 and gfx1201; clamp off), four byte
// products elsewhere.
__device__ int dot4_i8(unsigned int a, unsigned int b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
    return __dp4a((int)a, (int)b, c);
#elif defined(__gfx90a__) || defined(__gfx942__) || defined(__gfx1030__)
    return __builtin_amdgcn_sdot4((int)a, (int)b, c, false);
#elif defined(__gfx1100__) || defined(__gfx1201__)
    return __builtin_amdgcn_sudot4(true, (int)a, true, (int)b, c, false);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        c += (int)(signed char)(unsigned char)(a >> (8 * i)) * (int)(signed char)(unsigned char)(b >> (8 * i));
    }
    return c;
#endif
}

// The quants of v[0..7], elements of a block of the given amax (finite: the block holds no NaN or
// infinity), into words[0..1].
__device__ void quantize_part8(const float* v, float amax, bool finite, unsigned int* words) {
    const float r = 127.0f / amax;
    const bool usable = finite && r <= 3.40282347e38f;  // false for an all-zero block (r infinite)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        unsigned int word = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // the low byte of rint(v * r) + 1.5 * 2^23 is that of rint(v * r), two's complement
            const unsigned int q = usable ? float_to_bits(fmaf(v[4 * i + j], r, QUANT_ROUND_BIAS)) & 0xffu : 0u;
            word |= q << (8 * j);
        }
        words[i] = word;
    }
}

// The largest |v| of v[0..n), and whether all are finite.
__device__ float quantize_amax(const float* v, int n, bool* finite) {
    float amax = 0.0f;
    bool all_finite = true;
    for (int j = 0; j < n; ++j) {
        const float a = fabsf(v[j]);
        all_finite = all_finite && a <= 3.40282347e38f;  // false for NaN and infinities
        amax = a > amax ? a : amax;
    }
    *finite = all_finite;
    return amax;
}

// The scale d of a block of the given amax.
__device__ float quantize_d(float amax, bool finite) {
    return finite ? amax / 127.0f : bits_to_float(0x7fc00000u);
}

// s = d * sum(q) of a block's quants words[0..7].
__device__ float quantize_s(float d, const unsigned int* words) {
    int sum = 0;
#pragma unroll
    for (int i = 0; i < MOE_TILE_K / 4; ++i) {
        sum = dot4_i8(words[i], 0x01010101u, sum);
    }
    return d * (float)sum;
}

// Block v[0..31] quantized: its quants into words (four signed bytes a word, element 4i + j in byte
// j of word i) and its (d, s).
__device__ Int8Scales quantize_block32(const float* v, unsigned int* words) {
    bool finite;
    const float amax = quantize_amax(v, MOE_TILE_K, &finite);
#pragma unroll
    for (int p = 0; p < MOE_TILE_K / 8; ++p) {
        quantize_part8(v + 8 * p, amax, finite, words + 2 * p);
    }
    Int8Scales out;
    out.d = quantize_d(amax, finite);
    out.s = quantize_s(out.d, words);
    return out;
}

// Each byte v (0..15) to the signed byte v - 8: v + 0x78 stays below 0x100 (no carry into the next
// byte), and flipping bit 7 subtracts 0x80 modulo 256.
__device__ unsigned int nibbles_minus_8(unsigned int v) {
    return (v + 0x78787878u) ^ 0x80808080u;
}

// Whether every slice of TYPE is runs of 16 bytes that start 16 bytes apart in the block
// (unit_of(s, h) consecutive in h within each run of 16 / sizeof(Unit) units): such a slice
// is loaded 16 bytes at a time when its block is 16-byte aligned. Q4_K: the 16-byte header and
// 32 quant bytes; Q5_K: header and qh (48 bytes), 32 quant bytes; the float types: 32 elements.
template <int TYPE> struct GemvWide {
    static const bool value = TYPE == ES_TYPE_Q4_K || TYPE == ES_TYPE_Q5_K || TYPE == ES_TYPE_F16 ||
                              TYPE == ES_TYPE_BF16 || TYPE == ES_TYPE_F32;
};

// One slice's units as decode_slice reads them; the 16-byte words hold them for wide loads.
template <int TYPE> union GemvStaged {
    static const int WORDS = (BlockFormat<TYPE>::slice_units * (int)sizeof(typename BlockFormat<TYPE>::Unit) + 15) / 16;
    gemv_words4 words[WORDS];
    unsigned int pairs[WORDS * 4];
    typename BlockFormat<TYPE>::Unit units[WORDS * 16 / sizeof(typename BlockFormat<TYPE>::Unit)];
};

// The 32-bit word starting `shift` bits into lo, continued by hi: bytes cut across two aligned words.
__device__ unsigned int word_across(unsigned int lo, unsigned int hi, int shift) {
    return (unsigned int)((((unsigned long long)hi << 32) | lo) >> shift);
}

// The 16 units (32 bytes) at src, 2-byte aligned, into pairs[0..7]: as the nine 32-bit words from
// the one at or below src, each pair of units cut from two neighbouring words. Nine loads instead
// of sixteen. Where src is 4-byte aligned the ninth word holds none of the run's bytes and is not
// used: READ_NINTH reads it unconditionally (no predicate), for runs whose block goes on past
// that word (Q6_K's); runs that end their block (Q8_0's quants), where it may lie past the tensor,
// read it only where it holds some of them.
template <bool READ_NINTH> __device__ void gemv_load_run32(const unsigned char* src, unsigned int* pairs) {
    const unsigned int* words = (const unsigned int*)((unsigned long long)src & ~3ull);
    const int shift = 8 * (int)((unsigned long long)src & 3u);
    unsigned int w[9];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        w[i] = words[i];
    }
    w[8] = READ_NINTH || shift ? words[8] : 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        pairs[i] = word_across(w[i], w[i + 1], shift);
    }
}

// Stage slice ks of the row at `row` (n_in elements). For the float types a slice past n_in is
// partial: its units there are zeros, never read.
template <int TYPE>
__device__ void gemv_stage(const unsigned char* __restrict__ row, int ks, int n_in, GemvStaged<TYPE>& staged) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    const int RUN_UNITS = 16 / (int)sizeof(Unit);
    const int s = ks % SLICES;
    const unsigned char* block = row + (long long)(ks / SLICES) * BlockFormat<TYPE>::bytes;
    const bool whole = BlockFormat<TYPE>::quantized || ks * MOE_TILE_K + MOE_TILE_K <= n_in;
    if (GemvWide<TYPE>::value && whole && ((unsigned long long)block & 15u) == 0) {
#pragma unroll
        for (int r = 0; r < GemvStaged<TYPE>::WORDS; ++r) {
            staged.words[r] = *(const gemv_words4*)(block + BlockFormat<TYPE>::unit_of(s, r * RUN_UNITS) * sizeof(Unit));
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < UNITS; ++h) {
        const bool inside = BlockFormat<TYPE>::quantized || ks * MOE_TILE_K + h < n_in;
        staged.units[h] = inside ? ((const Unit*)block)[BlockFormat<TYPE>::unit_of(s, h)] : (Unit)0;
    }
}

// Q6_K's 210-byte blocks leave its runs 2-byte aligned: a slice's 32 ql bytes and 32 qh bytes (units
// 0-15 and 16-31, BlockFormat<Q6_K>) by gemv_load_run32, then its scale pair and d. The qh run ends
// 18 bytes before the block's end, the ql run 82 or more: the ninth word stays inside the block.
template <>
__device__ void gemv_stage<ES_TYPE_Q6_K>(const unsigned char* __restrict__ row, int ks, int, GemvStaged<ES_TYPE_Q6_K>& staged) {
    const int s = ks % 8;
    const int half = s >> 2;
    const unsigned char* block = row + (long long)(ks / 8) * BlockFormat<ES_TYPE_Q6_K>::bytes;
    gemv_load_run32<true>(block + 64 * half + 32 * (s & 1), staged.pairs);
    gemv_load_run32<true>(block + 128 + 32 * half, staged.pairs + 8);
    const unsigned short* units = (const unsigned short*)block;
    staged.units[32] = units[BlockFormat<ES_TYPE_Q6_K>::unit_of(s, 32)];
    staged.units[33] = units[BlockFormat<ES_TYPE_Q6_K>::unit_of(s, 33)];
}

// x_row[k0 .. k0 + N) into v, zero at and past n_in, from global memory: 4 floats at a time where the
// N elements lie inside the row and start 16-byte aligned.
template <int N> __device__ void gemv_load_x(const float* __restrict__ x_row, int k0, int n_in, float* v) {
    if (k0 + N <= n_in && ((unsigned long long)(x_row + k0) & 15u) == 0) {
#pragma unroll
        for (int q = 0; q < N / 4; ++q) {
            const vec4 w = *(const vec4*)(x_row + k0 + 4 * q);
            v[4 * q] = w.x;
            v[4 * q + 1] = w.y;
            v[4 * q + 2] = w.z;
            v[4 * q + 3] = w.w;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
        v[j] = k0 + j < n_in ? x_row[k0 + j] : 0.0f;
    }
}

// Slice ks of the activation row into a[0..31], zero at and past n_in: from shared memory where the
// row was staged (x_staged not null), else from global memory (gemv_load_x).
__device__ void gemv_x_slice(const float* x_staged, const float* __restrict__ x_row, int ks, int n_in, float* a) {
    const int k0 = ks * MOE_TILE_K;
    if (x_staged) {
        const float* xs = x_staged + ks * MOE_GEMV_STAGE_LD;
#pragma unroll
        for (int j = 0; j < MOE_TILE_K; ++j) {
            a[j] = k0 + j < n_in ? xs[j] : 0.0f;
        }
        return;
    }
    gemv_load_x<MOE_TILE_K>(x_row, k0, n_in, a);
}

// How many slices a row reads: its own, or for the tensor's last row (last_row) up to the next
// multiple of MOE_ROW_PADDING elements, ggml's padding tail, against zero activations, as the tile
// kernels read every row. Past any other row those elements are the next row's, times zero: the
// same sum, so they are not read.
template <int TYPE> __device__ int gemv_row_steps(int n_in, bool last_row) {
    return BlockFormat<TYPE>::quantized && last_row
               ? (n_in + MOE_ROW_PADDING - 1) / MOE_ROW_PADDING * (MOE_ROW_PADDING / MOE_TILE_K)
               : (n_in + MOE_TILE_K - 1) / MOE_TILE_K;
}

// How a wave's rows meet the activation row, by weight type (GemvX below):
// - float32 activations (the float types, and the quantized types without an int8 form here): each
//   slice decoded to 32 floats (decode_slice) and added as x * w, in ascending order;
// - int8 activations (GemvInt8: types whose quants are small integers under one scale, and a min,
//   per 32- or 16-element block, as on llama.cpp's q8_1 path): the row's activations go onto the int8
//   grid once per block (quantize_block32, moe_quantize_x's bytes), and each slice adds
//   fmaf(dw * dx, dot, acc) and, with a min, fmaf(-mw, s, acc), dot the int32 product of the two
//   blocks' quants: the products of int8.cu's kernels. A slice reads a third of the shared bytes
//   and no decoded floats stay live: a third fewer registers, so more warps a multiprocessor.
template <int TYPE> struct GemvInt8 {
    static const bool value = TYPE == ES_TYPE_Q4_0 || TYPE == ES_TYPE_Q4_K || TYPE == ES_TYPE_Q6_K ||
                              TYPE == ES_TYPE_Q8_0 || TYPE == ES_TYPE_MXFP4;
};

// The int8 path's Q8_0 slices (GemvInt8): the 32 quant bytes of the 34-byte block, 2-byte aligned, into
// pairs[0..7] by aligned words, and d into units[16]. (The float path's decode_slice reads the block's
// own layout: this staging serves GemvX<ES_TYPE_Q8_0, true> only.)
template <>
__device__ void gemv_stage<ES_TYPE_Q8_0>(const unsigned char* __restrict__ row, int ks, int, GemvStaged<ES_TYPE_Q8_0>& staged) {
    static_assert(GemvInt8<ES_TYPE_Q8_0>::value, "the float path reads decode_slice's layout");
    const unsigned char* block = row + (long long)ks * BlockFormat<ES_TYPE_Q8_0>::bytes;
    gemv_load_run32<false>(block + 2, staged.pairs);
    staged.units[16] = *(const unsigned short*)block;
}

// The int8 path's MXFP4 slices (GemvInt8): the 17-byte block, at any alignment, by the five aligned
// words that hold it (each holds at least one of its bytes, so none lies wholly past the tensor): its 16
// quant bytes into pairs[0..3], its E8M0 scale into pairs[4]. (The float path's decode_slice reads the
// block's own layout: this staging serves GemvX<ES_TYPE_MXFP4, true> only.)
template <>
__device__ void gemv_stage<ES_TYPE_MXFP4>(const unsigned char* __restrict__ row, int ks, int, GemvStaged<ES_TYPE_MXFP4>& staged) {
    static_assert(GemvInt8<ES_TYPE_MXFP4>::value, "the float path reads decode_slice's layout");
    const unsigned char* block = row + (long long)ks * BlockFormat<ES_TYPE_MXFP4>::bytes;
    const unsigned int* words = (const unsigned int*)((unsigned long long)block & ~3ull);
    const int at = (int)((unsigned long long)block & 3u);  // the scale's byte in words[0]
    unsigned int w[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) {
        w[i] = words[i];
    }
    // The quants start at byte at + 1 of the window: word 1 exactly where at is 3, else cut from two.
    const int shift = 8 * ((at + 1) & 3);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        staged.pairs[c] = at == 3 ? w[c + 1] : word_across(w[c], w[c + 1], shift);
    }
    staged.pairs[4] = (w[0] >> (8 * at)) & 0xffu;
}

#define MOE_GEMV_STAGE_Q8 8192  // int8 activation rows up to this many elements are staged in shared memory
#define MOE_GEMV_INT8_DEPTH 1   // MOE_GEMV_DEPTH of the int8 activations (2: decode 1% slower on an H100)

// One 32-element block of activations on the int8 grid: 32 quants (element 4i + j in byte j of
// q[i]) and its (d, s). 48 bytes, so eight lanes on neighbouring blocks read it in 16-byte loads
// from distinct banks.
struct alignas(16) GemvXq {
    unsigned int q[MOE_TILE_K / 4];
    Int8Scales scales;
    unsigned int unused[2];
};

template <int TYPE, bool INT8 = GemvInt8<TYPE>::value> struct GemvX;

template <int TYPE> struct GemvX<TYPE, false> {
    static const int DEPTH = MOE_GEMV_DEPTH;
    static const int CHUNK = 1 << 30;  // slices staged at once: the whole row
    struct Slice {
        float a[MOE_TILE_K];
    };
    // The row staged by the block (every thread calls it): each 32-element slice at its own bank
    // offset, so the lanes (each on its own slice) read it without conflicts; global reads of it
    // would fetch a separate line per lane. Null where the row is too long to stage.
    __device__ static const float* stage(const float* __restrict__ x_row, int n_in, int) {
        __shared__ float x_staged[MOE_GEMV_STAGE / MOE_TILE_K * MOE_GEMV_STAGE_LD];
        if (n_in > MOE_GEMV_STAGE) {  // the same for the whole block
            return 0;
        }
        for (int i = threadIdx.x; i < n_in; i += MOE_GEMV_THREADS) {
            x_staged[i / MOE_TILE_K * MOE_GEMV_STAGE_LD + i % MOE_TILE_K] = x_row[i];
        }
        __syncthreads();
        return x_staged;
    }
    __device__ static void load(const float* staged, const float* __restrict__ x_row, int ks, int n_in, Slice& x) {
        gemv_x_slice(staged, x_row, ks, n_in, x.a);
    }
    __device__ static float add(const typename BlockFormat<TYPE>::Unit* units, int s, const Slice& x, float acc) {
        float v[MOE_TILE_K];
        decode_slice<TYPE>(units, s, v);
#pragma unroll
        for (int j = 0; j < MOE_TILE_K; ++j) {
            acc = fmaf(x.a[j], v[j], acc);
        }
        return acc;
    }
};

template <int TYPE> struct GemvX<TYPE, true> {
    static const int DEPTH = MOE_GEMV_INT8_DEPTH;
    static const int CHUNK = MOE_GEMV_STAGE_Q8 / MOE_TILE_K;  // slices staged at once
    static_assert(CHUNK % (MOE_GEMV_WAVE * DEPTH) == 0, "a lane's slices continue into the next chunk");
    typedef GemvXq Slice;
    // Slices [c0, c0 + CHUNK) of the row quantized by the block's threads, four to a slice (eight
    // elements each), up to the padding tail's end (zeros past n_in): the bytes of quantize_block32,
    // s left for load(). Every thread calls it; it returns once every thread has finished reading
    // the chunk before. A slice's four parts are neighbouring threads: on NVIDIA they exchange their
    // amax by warp shuffles, one barrier a chunk; elsewhere through shared memory, two a round.
    __device__ static const GemvXq* stage(const float* __restrict__ x_row, int n_in, int c0) {
        __shared__ GemvXq xq_staged[CHUNK];
#if !defined(GEMV_WARP_PATHS)
        __shared__ float part_max[MOE_GEMV_THREADS];  // a part's amax, NaN where it is not finite
#else
        if (c0 > 0) {
            __syncthreads();  // the chunk before is read by every thread
        }
#endif
        const int padded = gemv_row_steps<TYPE>(n_in, true);
        const int blocks = padded - c0 < CHUNK ? padded - c0 : CHUNK;
        for (int first = 0; first < 4 * blocks; first += MOE_GEMV_THREADS) {  // the same rounds for every thread
            const int part = first + (int)threadIdx.x;
            const int k0 = MOE_TILE_K * c0 + 8 * part;
            float v[8];
            gemv_load_x<8>(x_row, k0, n_in, v);
            bool finite;
            const float amax = quantize_amax(v, 8, &finite);
            const float mine = finite ? amax : bits_to_float(0x7fc00000u);
            float parts[4];  // the amax of the slice's four parts, NaN where one is not finite
#if defined(GEMV_WARP_PATHS)
            const int own = threadIdx.x % 32 & ~3;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                parts[i] = __shfl_sync(0xffffffffu, mine, own + i);
            }
#else
            part_max[threadIdx.x] = mine;
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                parts[i] = part_max[(threadIdx.x & ~3) + i];
            }
#endif
            if (part < 4 * blocks) {
                float block_max = 0.0f;
                bool block_finite = true;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    block_finite = block_finite && parts[i] == parts[i];
                    block_max = parts[i] > block_max ? parts[i] : block_max;
                }
                GemvXq& xq = xq_staged[part / 4];
                quantize_part8(v, block_max, block_finite, xq.q + 2 * (part % 4));
                if (part % 4 == 0) {
                    xq.scales.d = quantize_d(block_max, block_finite);
                }
            }
#if !defined(GEMV_WARP_PATHS)
            __syncthreads();  // part_max is written again by the next round
#endif
        }
#if defined(GEMV_WARP_PATHS)
        __syncthreads();
#endif
        return xq_staged;
    }
    __device__ static void load(const GemvXq* staged, const float* __restrict__ x_row, int ks, int n_in, Slice& x) {
        x = staged[ks % CHUNK];
        x.scales.s = quantize_s(x.scales.d, x.q);
    }
    __device__ static float add(const typename BlockFormat<TYPE>::Unit* units, int s, const Slice& x, float acc);
};

// Q4_0: d, then 16 bytes holding element j in the low nibble of byte j and element j + 16 in the high.
template <>
__device__ float GemvX<ES_TYPE_Q4_0, true>::add(const unsigned short* units, int, const GemvXq& x, float acc) {
    int dot = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const unsigned int w = (unsigned int)units[1 + 2 * c] | ((unsigned int)units[2 + 2 * c] << 16);
        dot = dot4_i8(nibbles_minus_8(w & 0x0f0f0f0fu), x.q[c], dot);
        dot = dot4_i8(nibbles_minus_8((w >> 4) & 0x0f0f0f0fu), x.q[4 + c], dot);
    }
    return fmaf(half_to_float(units[0]) * x.scales.d, (float)dot, acc);
}

// Q8_0 (staged by gemv_stage<ES_TYPE_Q8_0>): the 32 signed quants in pairs 0-7, d in unit 16.
template <>
__device__ float GemvX<ES_TYPE_Q8_0, true>::add(const unsigned short* units, int, const GemvXq& x, float acc) {
    const unsigned int* pairs = (const unsigned int*)units;
    int dot = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        dot = dot4_i8(pairs[c], x.q[c], dot);
    }
    return fmaf(half_to_float(units[16]) * x.scales.d, (float)dot, acc);
}

// Each byte v (an MXFP4 code, 0..15) to the signed byte MXFP4_VALUES[v]: on NVIDIA two byte
// permutations (prmt) from the table's halves, 0..7 and 8..15, then each byte from the half its bit 3
// names; elsewhere a shift of the half's eight bytes per byte.
__device__ unsigned int mxfp4_codes_to_i8(unsigned int v) {
#if defined(__CUDA_ARCH__)
    const unsigned int negative = ((v >> 3) & 0x01010101u) * 0xffu;  // 0xff in the bytes of codes 8..15
    // code k & 7 in selector nibble k; its bit 3, which would make prmt replicate the byte's sign, clear
    const unsigned int t = v | (v >> 4);
    const unsigned int select = ((t & 0xffu) | ((t >> 8) & 0xff00u)) & 0x7777u;
    const unsigned int low = __byte_perm(0x03020100u, 0x0c080604u, select);      // 0, 1, 2, 3, 4, 6, 8, 12
    const unsigned int high = __byte_perm(0xfdfeff00u, 0xf4f8fafcu, select);     // 0, -1, ..., -12
    return (low & ~negative) | (high & negative);
#else
    unsigned int out = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned int code = (v >> (8 * j)) & 0xfu;
        const unsigned long long half = code & 8u ? 0xf4f8fafcfdfeff00ull : 0x0c08060403020100ull;
        out |= (unsigned int)((half >> (8 * (code & 7u))) & 0xffu) << (8 * j);
    }
    return out;
#endif
}

// MXFP4 (staged by gemv_stage<ES_TYPE_MXFP4>): element j of the block in the low nibble of quant byte
// j, element j + 16 in the high one, each a code of MXFP4_VALUES; the scale half the E8M0 power, as
// decode_slice takes it.
template <>
__device__ float GemvX<ES_TYPE_MXFP4, true>::add(const unsigned char* units, int, const GemvXq& x, float acc) {
    const unsigned int* pairs = (const unsigned int*)units;
    int dot = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        dot = dot4_i8(mxfp4_codes_to_i8(pairs[c] & 0x0f0f0f0fu), x.q[c], dot);
        dot = dot4_i8(mxfp4_codes_to_i8((pairs[c] >> 4) & 0x0f0f0f0fu), x.q[4 + c], dot);
    }
    return fmaf(e8m0_half(pairs[4]) * x.scales.d, (float)dot, acc);
}

// Q6_K: the slice's 32 low-bit bytes (units 0-15) and 32 high-bit bytes (units 16-31), its two
// signed 16-element scales (unit 32) and d (unit 33): element e of slice s is (low nibble s / 2 % 2 of
// byte e) | (bits 2 (s % 4) of byte 32 + e) << 4, minus 32. Each 16-element half adds its own dot.
template <>
__device__ float GemvX<ES_TYPE_Q6_K, true>::add(const unsigned short* units, int s, const GemvXq& x, float acc) {
    const int low_shift = 4 * ((s & 3) >> 1);
    const int high_shift = 2 * (s & 3);
    const float d = half_to_float(units[33]);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        int dot = 0;
#pragma unroll
        for (int c = 4 * part; c < 4 * part + 4; ++c) {
            const unsigned int low = (unsigned int)units[2 * c] | ((unsigned int)units[2 * c + 1] << 16);
            const unsigned int high = (unsigned int)units[16 + 2 * c] | ((unsigned int)units[17 + 2 * c] << 16);
            const unsigned int q = ((low >> low_shift) & 0x0f0f0f0fu) | (((high >> high_shift) & 0x03030303u) << 4);
            dot = dot4_i8((q + 0x60606060u) ^ 0x80808080u, x.q[c], dot);  // each byte q - 32, as nibbles_minus_8
        }
        const int sc = (int)(signed char)(unsigned char)(units[32] >> (8 * part));
        acc = fmaf(d * (float)sc * x.scales.d, (float)dot, acc);
    }
    return acc;
}

// Q4_K: the 16-byte header (d, dmin, the packed scales and mins), then the 32 quant bytes of the
// slice's pair: element j of slice s in nibble s % 2 of byte j.
template <>
__device__ float GemvX<ES_TYPE_Q4_K, true>::add(const unsigned short* units, int s, const GemvXq& x, float acc) {
    int sc;
    int m;
    k4_scale_min(units, s, &sc, &m);
    const int shift = 4 * (s & 1);
    int dot = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        const unsigned int w = (unsigned int)units[8 + 2 * c] | ((unsigned int)units[9 + 2 * c] << 16);
        dot = dot4_i8((w >> shift) & 0x0f0f0f0fu, x.q[c], dot);
    }
    acc = fmaf(half_to_float(units[0]) * (float)sc * x.scales.d, (float)dot, acc);
    return fmaf(-(half_to_float(units[1]) * (float)m), x.scales.s, acc);
}

// The sums of the wave's ROWS rows (rows[r], steps[r] slices; 0 for none) with x_row,
// valid at lane 0. Every thread of the block calls it. Lane l adds its slices l, l + 32, ... in
// ascending order (GemvX<TYPE>::add), then the wave adds its lanes (wave32_sum): a row's sum does
// not depend on the rows beside it. The activation slice is read once for all the wave's rows; the
// wave's first DEPTH slices of each row are loaded before the activations are staged, so they all
// wait on memory together.
template <int TYPE, int ROWS>
__device__ void gemv_wave_sums(const unsigned char* const* rows, const int* steps, const float* __restrict__ x_row,
                               int n_in, float* sums) {
#if defined(__CUDA_ARCH__)
    float* exchange = 0;
#else
    __shared__ float exchange[MOE_GEMV_THREADS];
#endif
    typedef GemvX<TYPE> X;
    const int DEPTH = X::DEPTH;
    const int lane = threadIdx.x % MOE_GEMV_WAVE;
    int max_steps = 0;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        max_steps = steps[r] > max_steps ? steps[r] : max_steps;
    }
    // DEPTH slices of each row in flight a lane: staged[d] holds slice lane + 32 (i + d) while
    // slice lane + 32 i is summed (at depth 2, a 2048-element row in one round trip). Each staged[d]
    // is indexed with a constant (the d loop unrolled).
    GemvStaged<TYPE> staged[DEPTH][ROWS];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (lane + MOE_GEMV_WAVE * d < steps[r]) {
                gemv_stage<TYPE>(rows[r], lane + MOE_GEMV_WAVE * d, n_in, staged[d][r]);
            }
        }
    }
    float partial[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        partial[r] = 0.0f;
    }
    // The activations in chunks of X::CHUNK slices (one for the float ones), the same for the whole
    // block: as many as the longest row of the tensor reads.
    const int row_slices = gemv_row_steps<TYPE>(n_in, true);
    for (int c0 = 0; c0 < row_slices; c0 += X::CHUNK) {
        const auto* x_staged = X::stage(x_row, n_in, c0);
        const int c1 = max_steps < c0 + X::CHUNK ? max_steps : c0 + X::CHUNK;
        for (int k0 = c0 + lane; k0 < c1; k0 += MOE_GEMV_WAVE * DEPTH) {
#pragma unroll
            for (int d = 0; d < DEPTH; ++d) {
                const int ks = k0 + MOE_GEMV_WAVE * d;
                if (ks < c1) {
                    typename X::Slice x;
                    X::load(x_staged, x_row, ks, n_in, x);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (ks < steps[r]) {
                            partial[r] = X::add(staged[d][r].units, ks % BlockFormat<TYPE>::slices, x, partial[r]);
                        }
                    }
                    const int next = ks + MOE_GEMV_WAVE * DEPTH;
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (next < steps[r]) {
                            gemv_stage<TYPE>(rows[r], next, n_in, staged[d][r]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        sums[r] = wave32_sum(partial[r], exchange);
    }
}

// The wave's WR rows o0, o0 + 1, ... of a tensor of n_out rows of n_in elements at w: where each starts
// and how many slices it reads (none past n_out; the last row's padding tail where padded_tail, as for
// the last row of the last expert).
template <int TYPE, int WR = MOE_GEMV_WAVE_ROWS>
__device__ void gemv_wave_rows(const unsigned char* w, int o0, int n_out, int n_in, bool padded_tail,
                               const unsigned char** rows, int* steps) {
    const long long row_bytes = weight_row_bytes<TYPE>(n_in);
#pragma unroll
    for (int r = 0; r < WR; ++r) {
        const int o = o0 + r;
        rows[r] = w + (long long)o * row_bytes;
        steps[r] = o < n_out ? gemv_row_steps<TYPE>(n_in, padded_tail && o == n_out - 1) : 0;
    }
}

// The block's rows of one tensor of n_out rows at w (its last row reading the padding tail) against
// the activation row x_row, each written to y_row[o]: a dense projection's share of one token.
template <int TYPE>
__device__ void gemv_block_rows(const unsigned char* w, const float* x_row, float* y_row, int n_out, int n_in) {
    const int lane = threadIdx.x % MOE_GEMV_WAVE;
    const int o0 = blockIdx.x * MOE_GEMV_ROWS + threadIdx.x / MOE_GEMV_WAVE * MOE_GEMV_WAVE_ROWS;
    const unsigned char* rows[MOE_GEMV_WAVE_ROWS];
    int steps[MOE_GEMV_WAVE_ROWS];
    gemv_wave_rows<TYPE>(w, o0, n_out, n_in, true, rows, steps);
    float sums[MOE_GEMV_WAVE_ROWS];
    gemv_wave_sums<TYPE, MOE_GEMV_WAVE_ROWS>(rows, steps, x_row, n_in, sums);
#pragma unroll
    for (int r = 0; r < MOE_GEMV_WAVE_ROWS; ++r) {
        if (lane == 0 && o0 + r < n_out) {
            y_row[o0 + r] = sums[r];
        }
    }
}

// The bytes of the block's BLOCK_ROWS rows of a tensor of n_out rows at w, asked into L2 (PREFETCH_L2) by
// the block's threads, a 128-byte line each in turn: a dense projection's weights, which are no kernel's
// output, before KERNEL_PROLOGUE's wait, so they come from L2 once the kernel before has finished. A
// prefetch reads nothing.
template <int TYPE, int BLOCK_ROWS = MOE_GEMV_ROWS>
__device__ void prefetch_block_rows(const unsigned char* w, int n_out, int n_in) {
    const int o0 = blockIdx.x * BLOCK_ROWS;
    if (o0 >= n_out) {
        return;
    }
    const long long row_bytes = weight_row_bytes<TYPE>(n_in);
    const long long bytes = min(BLOCK_ROWS, n_out - o0) * row_bytes;
    const unsigned char* start = w + o0 * row_bytes;
    for (long long at = threadIdx.x * 128ll; at < bytes; at += blockDim.x * 128ll) {
        PREFETCH_L2(start + at);
    }
    if (threadIdx.x == 0) {
        PREFETCH_L2(start + bytes - 1);  // the last line, where the rows do not start on one
    }
}

// prefetch_block_rows for a matrix-vector launch of one tensor (n_expert 1: a dense projection, its
// tensor known before the ids are read), WR rows a wave; nothing for experts.
template <int TYPE, int WR = MOE_GEMV_WAVE_ROWS>
__device__ void prefetch_dense_rows(const unsigned char* w, int n_expert, int n_out, int n_in) {
    if (n_expert == 1) {
        prefetch_block_rows<TYPE, MOE_GEMV_BLOCK_ROWS(WR)>(w, n_out, n_in);
    }
}

// prefetch_block_rows for mul_mat_vec_parts: the block's rows of its part.
template <int TYPE>
__device__ void prefetch_parts_rows(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,
                                    int n_out0, int n_out1, int n_out2, int n_in, int n_tokens) {
    const int part = blockIdx.y / n_tokens;
    prefetch_block_rows<TYPE>(part == 0 ? w0 : (part == 1 ? w1 : w2),
                              part == 0 ? n_out0 : (part == 1 ? n_out1 : n_out2), n_in);
}

// WR rows a wave (MOE_GEMV_WAVE_ROWS, or 1 for launches of few rows: below): each row's sum is the
// same whatever WR, since a row's lanes and their order do not depend on the rows beside it.
template <int TYPE, int WR = MOE_GEMV_WAVE_ROWS>
__device__ void mul_mat_vec_id(const unsigned char* __restrict__ w, const float* __restrict__ x,
                               const int* __restrict__ ids, float* __restrict__ y, int n_expert, int n_out, int n_in,
                               int top_k, int x_per_pair, int n_pairs, const float* __restrict__ route_weights,
                               const float* __restrict__ silu_gate) {
    const int pair = blockIdx.y;
    if (pair >= n_pairs) {
        return;
    }
    const int lane = threadIdx.x % MOE_GEMV_WAVE;
    const int o0 = blockIdx.x * MOE_GEMV_BLOCK_ROWS(WR) + threadIdx.x / MOE_GEMV_WAVE * WR;
    const int expert = ids[pair];
    if (expert < 0 || expert >= n_expert) {  // the same for the whole block: it returns before any barrier
#pragma unroll
        for (int r = 0; r < WR; ++r) {
            if (lane == 0 && o0 + r < n_out) {
                y[(long long)pair * n_out + o0 + r] = bits_to_float(0x7fc00000u);
            }
        }
        return;
    }
    const unsigned char* rows[WR];
    int steps[WR];
    const unsigned char* tensor = w + (long long)expert * n_out * weight_row_bytes<TYPE>(n_in);
    gemv_wave_rows<TYPE, WR>(tensor, o0, n_out, n_in, expert == n_expert - 1, rows, steps);
    float sums[WR];
    gemv_wave_sums<TYPE, WR>(rows, steps, x + (long long)(x_per_pair ? pair : pair / top_k) * n_in, n_in, sums);
#pragma unroll
    for (int r = 0; r < WR; ++r) {
        const int o = o0 + r;
        if (lane == 0 && o < n_out) {
            const long long at = (long long)pair * n_out + o;
            float value = route_weights ? route_weights[pair] * sums[r] : sums[r];
            if (silu_gate) {
                value = silu_times(silu_gate[at], value);
            }
            y[at] = value;
        }
    }
}

// gate_up_vec_id: SwiGLU's output of one token's pairs in one launch, y = silu(G x) * (U x) with G, U
// the pair's expert in w_gate and w_up (the same type and shape). A wave computes row o of both
// (its two rows side by side), a block MOE_GEMV_GATE_UP_ROWS outputs of one pair: grid
// (ceil(n_out / MOE_GEMV_GATE_UP_ROWS), n_pairs). Each sum is the one mul_mat_vec_id makes of that
// row, so y is the bytes of the gate launch followed by the up launch with silu_gate.
#define MOE_GEMV_GATE_UP_ROWS (MOE_GEMV_THREADS / MOE_GEMV_WAVE)

template <int TYPE>
__device__ void gate_up_vec_id(const unsigned char* __restrict__ w_gate, const unsigned char* __restrict__ w_up,
                               const float* __restrict__ x, const int* __restrict__ ids, float* __restrict__ y,
                               int n_expert, int n_out, int n_in, int top_k, int n_pairs) {
    const int pair = blockIdx.y;
    if (pair >= n_pairs) {
        return;
    }
    const int lane = threadIdx.x % MOE_GEMV_WAVE;
    const int o = blockIdx.x * MOE_GEMV_GATE_UP_ROWS + threadIdx.x / MOE_GEMV_WAVE;
    const int expert = ids[pair];
    if (expert < 0 || expert >= n_expert) {  // the same for the whole block: it returns before any barrier
        if (lane == 0 && o < n_out) {
            y[(long long)pair * n_out + o] = bits_to_float(0x7fc00000u);
        }
        return;
    }
    const long long at = ((long long)expert * n_out + o) * weight_row_bytes<TYPE>(n_in);
    const unsigned char* rows[2] = {w_gate + at, w_up + at};
    const int row_steps = o < n_out ? gemv_row_steps<TYPE>(n_in, expert == n_expert - 1 && o == n_out - 1) : 0;
    const int steps[2] = {row_steps, row_steps};
    float sums[2];
    gemv_wave_sums<TYPE, 2>(rows, steps, x + (long long)(pair / top_k) * n_in, n_in, sums);
    if (lane == 0 && o < n_out) {
        y[(long long)pair * n_out + o] = silu_times(sums[0], sums[1]);
    }
}

// mul_mat_vec_parts: up to three dense projections of the same activation rows in one launch, their
// weights of one type and row length (attention's Q, K and V). blockIdx.y = part * n_tokens + token;
// part p has n_out[p] rows in w[p] and writes y[p][token, :] (a part left out: n_out 0, its blocks
// return at once). Each row is summed as mul_mat_vec_id sums that tensor's row for one expert, so
// the outputs are the bytes of one launch per part.
template <int TYPE>
__device__ void mul_mat_vec_parts(const unsigned char* __restrict__ w0, const unsigned char* __restrict__ w1,
                                  const unsigned char* __restrict__ w2, const float* __restrict__ x,
                                  float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int n_out0,
                                  int n_out1, int n_out2, int n_in, int n_tokens) {
    const int part = blockIdx.y / n_tokens;
    const int token = blockIdx.y % n_tokens;
    const unsigned char* w = part == 0 ? w0 : (part == 1 ? w1 : w2);
    float* y = part == 0 ? y0 : (part == 1 ? y1 : y2);
    const int n_out = part == 0 ? n_out0 : (part == 1 ? n_out1 : n_out2);
    if ((int)blockIdx.x * MOE_GEMV_ROWS >= n_out) {  // the whole block, before any barrier: past this part's rows
        return;
    }
    gemv_block_rows<TYPE>(w, x + (long long)token * n_in, y + (long long)token * n_out, n_out, n_in);
}

#define MOE_MUL_MAT_VEC_ID(NAME, TYPE)                                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))            \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x, const int* __restrict__ ids, \
             float* __restrict__ y, int n_expert, int n_out, int n_in, int top_k, int x_per_pair,           \
             int n_pairs, const float* __restrict__ route_weights, const float* __restrict__ silu_gate) {   \
        prefetch_dense_rows<TYPE>(w, n_expert, n_out, n_in);                                                \
        KERNEL_PROLOGUE();                                                                                  \
        mul_mat_vec_id<TYPE>(w, x, ids, y, n_expert, n_out, n_in, top_k, x_per_pair, n_pairs,               \
                             route_weights, silu_gate);                                                     \
    }
// The same with one row a wave, for launches of fewer than GEMV_ONE_ROW_UNDER rows over all their pairs
// (layout.py): there two rows a wave leave too few waves to keep the memory busy (an attention output
// projection of 2048 rows: 1024 waves, under 8 a multiprocessor of an H100; 17-27% faster with one row a
// wave, docs/results/decode-rows-h100.md). Grid (ceil(n_out / MOE_GEMV_BLOCK_ROWS(1)), n_pairs).
#define MOE_MUL_MAT_VEC_ID1(NAME, TYPE)                                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))            \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x, const int* __restrict__ ids, \
             float* __restrict__ y, int n_expert, int n_out, int n_in, int top_k, int x_per_pair,           \
             int n_pairs, const float* __restrict__ route_weights, const float* __restrict__ silu_gate) {   \
        prefetch_dense_rows<TYPE, 1>(w, n_expert, n_out, n_in);                                             \
        KERNEL_PROLOGUE();                                                                                  \
        mul_mat_vec_id<TYPE, 1>(w, x, ids, y, n_expert, n_out, n_in, top_k, x_per_pair, n_pairs,            \
                                route_weights, silu_gate);                                                  \
    }
#define MOE_GATE_UP_VEC_ID(NAME, TYPE)                                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))            \
        NAME(const unsigned char* __restrict__ w_gate, const unsigned char* __restrict__ w_up,              \
             const float* __restrict__ x, const int* __restrict__ ids, float* __restrict__ y, int n_expert, \
             int n_out, int n_in, int top_k, int n_pairs) {                                                 \
        KERNEL_PROLOGUE();                                                                                  \
        gate_up_vec_id<TYPE>(w_gate, w_up, x, ids, y, n_expert, n_out, n_in, top_k, n_pairs);               \
    }
#define MOE_MUL_MAT_VEC_PARTS(NAME, TYPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS_OF(TYPE))           \
        NAME(const unsigned char* __restrict__ w0, const unsigned char* __restrict__ w1,                   \
             const unsigned char* __restrict__ w2, const float* __restrict__ x, float* __restrict__ y0,    \
             float* __restrict__ y1, float* __restrict__ y2, int n_out0, int n_out1, int n_out2, int n_in, \
             int n_tokens) {                                                                               \
        prefetch_parts_rows<TYPE>(w0, w1, w2, n_out0, n_out1, n_out2, n_in, n_tokens);                     \
        KERNEL_PROLOGUE();                                                                                 \
        mul_mat_vec_parts<TYPE>(w0, w1, w2, x, y0, y1, y2, n_out0, n_out1, n_out2, n_in, n_tokens);        \
    }
// Instances (one per weight type of layout.FORMATS) are appended after the last file by
// kernel_source (program.py), for the types a module needs.

// Mixture-of-Experts kernels: one source for NVRTC (CUDA) and hipRTC (HIP).
//
// Portability rules this file keeps:
// - no includes: f16 and bf16 are decoded from their bits by hand;
// - no warp-level intrinsics: every cooperation goes through shared memory and
//   __syncthreads, so the code is correct for any wavefront size (32 on NVIDIA,
//   64 on most AMD GPUs);
// - explicit fmaf, so both compilers accumulate with the same contraction.
//
// Weight layouts are ggml's (ggml-common.h): a 3-D expert tensor [n_expert][n_out][n_in]
// of rows of n_in elements, contiguous, each row a run of blocks. The matrix kernel steps
// k by 32 elements: one block of the 32-element types, one slice of the 256-element ones
// (K-quants, IQ4_XS), which it decodes with the block's shared scales.

#define ES_TYPE_F32 0
#define ES_TYPE_F16 1
#define ES_TYPE_Q4_0 2
#define ES_TYPE_Q4_1 3
#define ES_TYPE_Q5_0 6
#define ES_TYPE_Q5_1 7
#define ES_TYPE_Q8_0 8
#define ES_TYPE_Q2_K 10
#define ES_TYPE_Q3_K 11
#define ES_TYPE_Q4_K 12
#define ES_TYPE_Q5_K 13
#define ES_TYPE_Q6_K 14
#define ES_TYPE_IQ4_NL 20
#define ES_TYPE_IQ4_XS 23
#define ES_TYPE_BF16 30
#define ES_TYPE_MXFP4 39

// Must match expertstream/kernels/layout.py.
#define MOE_MAX_EXPERTS 1024      // buckets in the grouping kernel (plus one for bad ids)
#define MOE_SCRATCH_HEADER 4      // ints before the tile table
#define MOE_TILE_N 128            // outputs per block in mul_mat_id
#define MOE_TILE_K 32             // elements per k step: one block or one 32-element slice
#define MOE_ROW_PADDING 512       // quantized rows are read in blocks of this many elements
#define MOE_MMID_THREADS 128
#define MOE_GROUP_THREADS 1024
#define ROUTER_TOKENS 8           // tokens per block in router_topk
#define ROUTER_EXPERT_CHUNK 64    // experts per pass over n_embd
#define ROUTER_MAX_EXPERTS 512
#define ROUTER_MAX_K 32
#define ROUTER_THREADS 256        // ROUTER_TOKENS groups of 32 threads

struct alignas(16) vec4 {
    float x, y, z, w;
};

__device__ float bits_to_float(unsigned int bits) {
    union {
        unsigned int u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

// Exact for normals, subnormals, infinities and NaNs: the exponent is rebased by a
// multiplication with 2^112, which is exact for every finite half.
__device__ float half_to_float(unsigned int h) {
    unsigned int magnitude = (h & 0x7fffu) << 13;
    if ((h & 0x7c00u) == 0x7c00u) {
        magnitude |= 0x7f800000u;
    }
    float f = bits_to_float(magnitude) * bits_to_float(0x77800000u);
    return (h & 0x8000u) ? -f : f;
}

__device__ float bf16_to_float(unsigned int h) {
    return bits_to_float(h << 16);
}

// How each type is read. Per k step the kernel stages, for every row of the tile,
// `slice_units` units of `Unit` (16 bits for most types; bytes for MXFP4, whose 17-byte
// blocks break 16-bit alignment; 32-bit words for F32): unit h of slice s is unit
// unit_of(s, h) of the block. decode_slice turns the staged units of slice s into 32
// floats. `bytes` is the size of one block (of 32 elements for the float types).
template <int TYPE> struct BlockFormat;

// 32-element blocks: the slice is the whole block.
#define ES_WHOLE_BLOCK(TYPE, UNIT, BYTES)                                    \
    template <> struct BlockFormat<TYPE> {                                   \
        typedef UNIT Unit;                                                   \
        static const int bytes = BYTES;                                      \
        static const int slices = 1;                                         \
        static const int slice_units = BYTES / (int)sizeof(UNIT);            \
        static const bool quantized = TYPE != ES_TYPE_F32 && TYPE != ES_TYPE_F16 && TYPE != ES_TYPE_BF16; \
        __device__ static int unit_of(int, int h) { return h; }              \
    };

ES_WHOLE_BLOCK(ES_TYPE_Q4_0, unsigned short, 18)
ES_WHOLE_BLOCK(ES_TYPE_Q4_1, unsigned short, 20)
ES_WHOLE_BLOCK(ES_TYPE_Q5_0, unsigned short, 22)
ES_WHOLE_BLOCK(ES_TYPE_Q5_1, unsigned short, 24)
ES_WHOLE_BLOCK(ES_TYPE_Q8_0, unsigned short, 34)
ES_WHOLE_BLOCK(ES_TYPE_IQ4_NL, unsigned short, 18)
ES_WHOLE_BLOCK(ES_TYPE_MXFP4, unsigned char, 17)
ES_WHOLE_BLOCK(ES_TYPE_F16, unsigned short, 64)
ES_WHOLE_BLOCK(ES_TYPE_BF16, unsigned short, 64)
ES_WHOLE_BLOCK(ES_TYPE_F32, unsigned int, 128)

// 256-element blocks: slice s stages the block's scales and the quants of its 32 elements.
// Q2_K: scales[16] qs[64] d dmin. Slice s = 4 * half + j: the scale pair of bytes
// 8 * half + 2j, 2-bit quants j of the 32 bytes of its half, d and dmin.
template <> struct BlockFormat<ES_TYPE_Q2_K> {
    typedef unsigned short Unit;
    static const int bytes = 84;
    static const int slices = 8;
    static const int slice_units = 19;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        return h == 0 ? 4 * (s >> 2) + (s & 3) : (h < 17 ? 8 + 16 * (s >> 2) + h - 1 : 40 + h - 17);
    }
};
// Q3_K: hmask[32] qs[64] scales[12] d. Slice s = 4 * half + j: all of hmask (bit s), the
// 32 quant bytes of its half, the scales and d.
template <> struct BlockFormat<ES_TYPE_Q3_K> {
    typedef unsigned short Unit;
    static const int bytes = 110;
    static const int slices = 8;
    static const int slice_units = 39;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        return h < 16 ? h : (h < 32 ? 16 + 16 * (s >> 2) + h - 16 : 48 + h - 32);
    }
};
// Q4_K: d dmin scales[12] qs[128]. Slice s: the header and the 32 bytes of group s / 2,
// whose low nibbles are slice 2g and high nibbles slice 2g + 1.
template <> struct BlockFormat<ES_TYPE_Q4_K> {
    typedef unsigned short Unit;
    static const int bytes = 144;
    static const int slices = 8;
    static const int slice_units = 24;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 8 ? h : 8 + 16 * (s >> 1) + h - 8; }
};
// Q5_K: d dmin scales[12] qh[32] qs[128]: as Q4_K, plus all of qh (bit s).
template <> struct BlockFormat<ES_TYPE_Q5_K> {
    typedef unsigned short Unit;
    static const int bytes = 176;
    static const int slices = 8;
    static const int slice_units = 40;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 24 ? h : 24 + 16 * (s >> 1) + h - 24; }
};
// Q6_K: ql[128] qh[64] scales[16] d. Slice s = 4 * half + r: 32 ql bytes (nibble r / 2 of
// part r % 2 of the half), the 32 qh bytes of the half (bits 2r..2r+1), a scale pair, d.
template <> struct BlockFormat<ES_TYPE_Q6_K> {
    typedef unsigned short Unit;
    static const int bytes = 210;
    static const int slices = 8;
    static const int slice_units = 34;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        const int half = s >> 2;
        const int r = s & 3;
        if (h < 16) {
            return 32 * half + 16 * (r & 1) + h;
        }
        if (h < 32) {
            return 64 + 16 * half + h - 16;
        }
        return h == 32 ? 96 + 4 * half + r : 104;
    }
};
// IQ4_XS: d scales_h scales_l[4] qs[128]. Slice s: the header and its 16 quant bytes.
template <> struct BlockFormat<ES_TYPE_IQ4_XS> {
    typedef unsigned short Unit;
    static const int bytes = 136;
    static const int slices = 8;
    static const int slice_units = 12;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 4 ? h : 4 + 8 * s + h - 4; }
};

__device__ unsigned int block_byte(const unsigned short* units, int i) {
    return (units[i >> 1] >> ((i & 1) * 8)) & 0xffu;
}

__device__ unsigned int block_byte(const unsigned char* units, int i) {
    return units[i];
}

__device__ const signed char IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
__device__ const signed char MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Decode staged slice s into 32 floats, with the float32 operations of ggml's reference
// dequantization in its order (the Python twins in quants.py repeat them).
template <int TYPE>
__device__ void decode_slice(const typename BlockFormat<TYPE>::Unit* units, int s, float* out);

template <> __device__ void decode_slice<ES_TYPE_Q4_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)((q & 0xf) - 8);
        out[j + 16] = d * (float)((q >> 4) - 8);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q4_1>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const float m = half_to_float(units[1]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 4 + j);
        out[j] = fmaf(d, (float)(q & 0xf), m);
        out[j + 16] = fmaf(d, (float)(q >> 4), m);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const unsigned int qh = units[1] | ((unsigned int)units[2] << 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 6 + j);
        const int high_low = (int)((qh >> j) & 1u) << 4;
        const int high_high = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = d * (float)(((q & 0xf) | high_low) - 16);
        out[j + 16] = d * (float)(((q >> 4) | high_high) - 16);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_1>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const float m = half_to_float(units[1]);
    const unsigned int qh = units[2] | ((unsigned int)units[3] << 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 8 + j);
        const int high_low = (int)((qh >> j) & 1u) << 4;
        const int high_high = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = fmaf(d, (float)((q & 0xf) | high_low), m);
        out[j + 16] = fmaf(d, (float)((q >> 4) | high_high), m);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q8_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)(q >= 128 ? q - 256 : q);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ4_NL>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)IQ4_VALUES[q & 0xf];
        out[j + 16] = d * (float)IQ4_VALUES[q >> 4];
    }
}

// Half the E8M0 scale, 2^(e - 128); subnormal below e = 2, as ggml computes it.
__device__ float e8m0_half(unsigned int e) {
    return bits_to_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

template <> __device__ void decode_slice<ES_TYPE_MXFP4>(const unsigned char* units, int, float* out) {
    const float d = e8m0_half(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = units[1 + j];
        out[j] = d * (float)MXFP4_VALUES[q & 0xf];
        out[j + 16] = d * (float)MXFP4_VALUES[q >> 4];
    }
}

template <> __device__ void decode_slice<ES_TYPE_F16>(const unsigned short* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = half_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_BF16>(const unsigned short* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = bf16_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_F32>(const unsigned int* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = bits_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q2_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[17]);
    const float dmin = half_to_float(units[18]);
    const int shift = 2 * (s & 3);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const int sc = (int)block_byte(units, part);
        const float dl = d * (float)(sc & 0xf);
        const float ml = dmin * (float)(sc >> 4);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int q = ((int)block_byte(units, 2 + 16 * part + l) >> shift) & 3;
            out[16 * part + l] = dl * (float)q - ml;
        }
    }
}

// Scale i (0..15) of Q3_K from its 12 packed bytes: low 4 bits from byte i % 8 (nibble i / 8),
// high 2 bits from byte 8 + i % 4 (bits 2 * (i / 4)).
__device__ int q3_k_scale(const unsigned short* units, int packed_at, int i) {
    const int low = ((int)block_byte(units, packed_at + (i & 7)) >> (4 * (i >> 3))) & 0xf;
    const int high = ((int)block_byte(units, packed_at + 8 + (i & 3)) >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

template <> __device__ void decode_slice<ES_TYPE_Q3_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[38]);
    const int shift = 2 * (s & 3);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const float dl = d * (float)q3_k_scale(units, 64, 2 * s + part);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int e = 16 * part + l;
            const int low = ((int)block_byte(units, 32 + e) >> shift) & 3;
            const int high = ((int)block_byte(units, e) >> s) & 1;
            out[e] = dl * (float)(low - (high ? 0 : 4));
        }
    }
}

// Scale and min j (0..7) of Q4_K / Q5_K from their 12 packed bytes at byte 4.
__device__ void k4_scale_min(const unsigned short* units, int j, int* sc, int* m) {
    const int at = 4;
    if (j < 4) {
        *sc = (int)block_byte(units, at + j) & 63;
        *m = (int)block_byte(units, at + j + 4) & 63;
    } else {
        const int high = (int)block_byte(units, at + j + 4);
        *sc = (high & 0xf) | (((int)block_byte(units, at + j - 4) >> 6) << 4);
        *m = (high >> 4) | (((int)block_byte(units, at + j) >> 6) << 4);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q4_K>(const unsigned short* units, int s, float* out) {
    int sc;
    int m;
    k4_scale_min(units, s, &sc, &m);
    const float d = half_to_float(units[0]) * (float)sc;
    const float dm = half_to_float(units[1]) * (float)m;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = ((int)block_byte(units, 16 + l) >> shift) & 0xf;
        out[l] = d * (float)q - dm;
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_K>(const unsigned short* units, int s, float* out) {
    int sc;
    int m;
    k4_scale_min(units, s, &sc, &m);
    const float d = half_to_float(units[0]) * (float)sc;
    const float dm = half_to_float(units[1]) * (float)m;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int low = ((int)block_byte(units, 48 + l) >> shift) & 0xf;
        const int high = ((int)block_byte(units, 16 + l) >> s) & 1;
        out[l] = d * (float)(low | (high << 4)) - dm;
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q6_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[33]);
    const int r = s & 3;
    const int low_shift = 4 * (r >> 1);
    const int high_shift = 2 * r;
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const int sc = (int)block_byte(units, 64 + part);
        const float dl = d * (float)(sc >= 128 ? sc - 256 : sc);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int e = 16 * part + l;
            const int low = ((int)block_byte(units, e) >> low_shift) & 0xf;
            const int high = ((int)block_byte(units, 32 + e) >> high_shift) & 3;
            out[e] = dl * (float)((low | (high << 4)) - 32);
        }
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ4_XS>(const unsigned short* units, int s, float* out) {
    const int low = ((int)block_byte(units, 4 + (s >> 1)) >> (4 * (s & 1))) & 0xf;
    const int high = (units[1] >> (2 * s)) & 3;
    const float dl = half_to_float(units[0]) * (float)((low | (high << 4)) - 32);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 8 + j);
        out[j] = dl * (float)IQ4_VALUES[q & 0xf];
        out[j + 16] = dl * (float)IQ4_VALUES[q >> 4];
    }
}

// ---------------------------------------------------------------------------------
// Grouping: bucket the (token, slot) pairs by expert and cut each bucket into tiles.
//
// scratch (int32): [0] number of tiles; from MOE_SCRATCH_HEADER, max_tiles triples
// (expert, first row, row count); then n_pairs row entries (pair index t * top_k + k)
// sorted by expert. Ids outside [0, n_expert) go to bucket n_expert, whose outputs the
// matrix kernel fills with NaN instead of reading memory out of range. The order of
// pairs inside a bucket depends on atomics; no output value depends on it, because
// every output element is one thread's dot product in a fixed order.
// ---------------------------------------------------------------------------------

__device__ int bucket_of(int id, int n_expert) {
    return (unsigned int)id < (unsigned int)n_expert ? id : n_expert;
}

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS) moe_group_by_expert(
    const int* __restrict__ ids, int* __restrict__ scratch, int n_pairs, int n_expert, int tile_m,
    int max_tiles) {
    __shared__ int count[MOE_MAX_EXPERTS + 1];
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];
    __shared__ int first_tile[MOE_MAX_EXPERTS + 1];
    const int n_buckets = n_expert + 1;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        count[e] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        atomicAdd(&count[bucket_of(ids[p], n_expert)], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int offset = 0;
        int tiles = 0;
        for (int e = 0; e < n_buckets; ++e) {
            cursor[e] = offset;
            first_tile[e] = tiles;
            offset += count[e];
            tiles += (count[e] + tile_m - 1) / tile_m;
        }
        scratch[0] = tiles;
    }
    __syncthreads();
    int* tile_table = scratch + MOE_SCRATCH_HEADER;
    int* rows = tile_table + 3 * max_tiles;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        int t = first_tile[e];
        for (int begin = 0; begin < count[e]; begin += tile_m, ++t) {
            tile_table[3 * t] = e;
            tile_table[3 * t + 1] = cursor[e] + begin;
            tile_table[3 * t + 2] = count[e] - begin < tile_m ? count[e] - begin : tile_m;
        }
    }
    __syncthreads();  // the loop above reads cursor before the scatter below advances it
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        rows[atomicAdd(&cursor[bucket_of(ids[p], n_expert)], 1)] = p;
    }
}

// ---------------------------------------------------------------------------------
// mul_mat_id: y[p, :] = W[expert(p)] @ x[row(p)] for the pairs of one tile.
//
// One block computes TILE_M pairs x MOE_TILE_N outputs; each thread a TM x 8 register
// block (rows i*8 + tm, columns j*16 + tn: the strided layout keeps the 16-byte
// shared-memory reads free of bank conflicts). Per k step the block loads the raw
// weight blocks cooperatively (coalesced), decodes them once into shared memory, and
// loads the activations. Each output is one thread's sum over k in ascending order, so
// results do not depend on the tile a pair lands in.
//
// Quantized rows are read up to the next multiple of MOE_ROW_PADDING elements, as
// ggml's MMQ does: past the last row that is the tensor's padding tail. Activations
// there are zero, so those weights are folded in as 0 * w: zero when the bytes hold
// finite values, NaN when they do not (a dirty tail shows).
// ---------------------------------------------------------------------------------

// What the padded part of one row adds to its dot products: quantized rows are read up to
// the next multiple of MOE_ROW_PADDING elements, as ggml's MMQ reads them, against zero
// activations, so this is 0 * w summed over the tail: zero when the bytes there decode to
// finite values, NaN when they do not (a dirty tail shows). Zero for the float types.
template <int TYPE>
__device__ float padding_tail(const unsigned char* __restrict__ row, int n_in) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    float tail_sum = 0.0f;
    if (!BlockFormat<TYPE>::quantized) {
        return tail_sum;
    }
    const int padded_steps = (n_in + MOE_ROW_PADDING - 1) / MOE_ROW_PADDING * (MOE_ROW_PADDING / MOE_TILE_K);
    for (int ks = n_in / MOE_TILE_K; ks < padded_steps; ++ks) {
        const Unit* block = (const Unit*)(row + (long long)(ks / SLICES) * BlockFormat<TYPE>::bytes);
        Unit staged[UNITS];
#pragma unroll
        for (int h = 0; h < UNITS; ++h) {
            staged[h] = block[BlockFormat<TYPE>::unit_of(ks % SLICES, h)];
        }
        float v[32];
        decode_slice<TYPE>(staged, ks % SLICES, v);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            tail_sum += 0.0f * v[j];
        }
    }
    return tail_sum;
}

template <int TYPE, int TILE_M>
__device__ void mul_mat_id_tile(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                const int* __restrict__ scratch, float* __restrict__ y, int n_expert,
                                int n_out, int n_in, int top_k, int x_per_slot, int max_tiles) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    const int BLOCK_BYTES = BlockFormat<TYPE>::bytes;
    const int ROW_WORDS = (UNITS * (int)sizeof(Unit) + 3) / 4;
    const int RAW_STRIDE = (ROW_WORDS | 1) * 4 / (int)sizeof(Unit);  // odd words per row: no bank conflicts
    const int TM = TILE_M / 8;
    const int LDS = MOE_TILE_K + 4;  // floats per shared row; keeps rows 16-byte aligned

    __shared__ vec4 x_tile[TILE_M][LDS / 4];
    __shared__ vec4 w_tile[MOE_TILE_N][LDS / 4];
    __shared__ Unit raw[MOE_TILE_N * RAW_STRIDE];
    __shared__ int src_row[TILE_M];
    __shared__ int dst_row[TILE_M];
    __shared__ float tail[MOE_TILE_N];

    const int tile = blockIdx.y;
    if (tile >= scratch[0]) {
        return;
    }
    const int* entry = scratch + MOE_SCRATCH_HEADER + 3 * tile;
    const int expert = entry[0];
    const int first = entry[1];
    const int count = entry[2];
    const int* rows = scratch + MOE_SCRATCH_HEADER + 3 * max_tiles;
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * MOE_TILE_N;

    for (int m = tid; m < TILE_M; m += MOE_MMID_THREADS) {
        const int p = m < count ? rows[first + m] : -1;
        dst_row[m] = p;
        src_row[m] = p < 0 ? -1 : (x_per_slot ? p : p / top_k);
    }
    __syncthreads();

    if (expert == n_expert) {  // the bucket of out-of-range ids
        for (int i = tid; i < count * MOE_TILE_N; i += MOE_MMID_THREADS) {
            const int o = n0 + i % MOE_TILE_N;
            if (o < n_out) {
                y[(long long)dst_row[i / MOE_TILE_N] * n_out + o] = bits_to_float(0x7fc00000u);
            }
        }
        return;
    }

    const long long row_bytes = BlockFormat<TYPE>::quantized
                                    ? (long long)(n_in / (MOE_TILE_K * SLICES)) * BLOCK_BYTES
                                    : (long long)n_in * (BLOCK_BYTES / MOE_TILE_K);
    const unsigned char* w_expert = w + (long long)expert * n_out * row_bytes;
    const int expert_row_bytes = (int)row_bytes;
    const int k_steps = (n_in + MOE_TILE_K - 1) / MOE_TILE_K;

    // The padded part of quantized rows: thread tid reads row n0 + tid directly.
    const float tail_sum =
        n0 + tid < n_out ? padding_tail<TYPE>(w_expert + (long long)(n0 + tid) * row_bytes, n_in) : 0.0f;
    tail[tid] = tail_sum;  // read after the k loop, whose barriers order it

    const int tm = tid / 16;
    const int tn = tid % 16;
    float acc[TM][8];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[i][j] = 0.0f;
        }
    }

    // One k step's global data, staged in registers: thread tid holds staged unit
    // tid + r * MOE_MMID_THREADS of the raw weight tile (consecutive threads read
    // consecutive units of a row: coalesced) and activation row tid / 32 + r * 4, column
    // tid % 32. For the float types unit h is element k0 + h.
    const int X_PER_THREAD = TILE_M * MOE_TILE_K / MOE_MMID_THREADS;
    Unit raw_regs[UNITS];
    float x_regs[X_PER_THREAD];
    auto load_step = [&](int ks) {
        const int k0 = ks * MOE_TILE_K;
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int i = tid + r * MOE_MMID_THREADS;
            const int n = i / UNITS;
            const int h = i - n * UNITS;
            Unit v = 0;
            if (n0 + n < n_out && (BlockFormat<TYPE>::quantized || k0 + h < n_in)) {
                // 32-bit offsets inside one expert (the launcher checks they fit): fewer registers.
                const int offset = (n0 + n) * expert_row_bytes + (ks / SLICES) * BLOCK_BYTES;
                v = ((const Unit*)(w_expert + offset))[BlockFormat<TYPE>::unit_of(ks % SLICES, h)];
            }
            raw_regs[r] = v;
        }
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int src = src_row[tid / MOE_TILE_K + r * (MOE_MMID_THREADS / MOE_TILE_K)];
            const int k = k0 + tid % MOE_TILE_K;
            x_regs[r] = (src >= 0 && k < n_in) ? x[(long long)src * n_in + k] : 0.0f;
        }
    };
    auto store_step = [&]() {
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int i = tid + r * MOE_MMID_THREADS;
            const int n = i / UNITS;
            raw[n * RAW_STRIDE + i - n * UNITS] = raw_regs[r];
        }
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int m = tid / MOE_TILE_K + r * (MOE_MMID_THREADS / MOE_TILE_K);
            ((float*)x_tile[m])[tid % MOE_TILE_K] = x_regs[r];
        }
    };

    for (int ks = 0; ks < k_steps; ++ks) {
        // All loads of a step are issued before the first store. Loading the next step
        // during this one's compute measured no faster on the H200: the extra registers
        // cost more occupancy than the overlap gained.
        load_step(ks);
        store_step();
        __syncthreads();
        {
            float v[32];
            decode_slice<TYPE>(raw + tid * RAW_STRIDE, ks % SLICES, v);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                vec4 packed;
                packed.x = v[4 * q];
                packed.y = v[4 * q + 1];
                packed.z = v[4 * q + 2];
                packed.w = v[4 * q + 3];
                w_tile[tid][q] = packed;
            }
        }
        __syncthreads();
        // Not unrolled: full unrolling lets the compiler hoist shared loads into up to 255
        // registers, which costs more in occupancy than it gains (measured on the H200).
#pragma unroll 1
        for (int kq = 0; kq < MOE_TILE_K / 4; ++kq) {
            vec4 a[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                a[i] = x_tile[i * 8 + tm][kq];
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const vec4 b = w_tile[j * 16 + tn][kq];
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    acc[i][j] = fmaf(a[i].x, b.x, acc[i][j]);
                    acc[i][j] = fmaf(a[i].y, b.y, acc[i][j]);
                    acc[i][j] = fmaf(a[i].z, b.z, acc[i][j]);
                    acc[i][j] = fmaf(a[i].w, b.w, acc[i][j]);
                }
            }
        }
        __syncthreads();
    }


#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int p = dst_row[i * 8 + tm];
        if (p < 0) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int o = n0 + j * 16 + tn;
            if (o < n_out) {
                y[(long long)p * n_out + o] = acc[i][j] + tail[j * 16 + tn];
            }
        }
    }
}

#define MOE_MUL_MAT_ID(NAME, TYPE, TILE_M)                                                                \
    extern "C" __global__ void __launch_bounds__(MOE_MMID_THREADS)                                      \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x,                         \
             const int* __restrict__ scratch, float* __restrict__ y, int n_expert, int n_out, int n_in, \
             int top_k, int x_per_slot, int max_tiles) {                                                \
        mul_mat_id_tile<TYPE, TILE_M>(w, x, scratch, y, n_expert, n_out, n_in, top_k, x_per_slot,      \
                                      max_tiles);                                                       \
    }

MOE_MUL_MAT_ID(moe_mul_mat_id_q4_0_m32, ES_TYPE_Q4_0, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q4_0_m64, ES_TYPE_Q4_0, 64)
MOE_MUL_MAT_ID(moe_mul_mat_id_q4_1_m32, ES_TYPE_Q4_1, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q5_0_m32, ES_TYPE_Q5_0, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q5_1_m32, ES_TYPE_Q5_1, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q8_0_m32, ES_TYPE_Q8_0, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q2_k_m32, ES_TYPE_Q2_K, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q3_k_m32, ES_TYPE_Q3_K, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q4_k_m32, ES_TYPE_Q4_K, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q5_k_m32, ES_TYPE_Q5_K, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_q6_k_m32, ES_TYPE_Q6_K, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_iq4_nl_m32, ES_TYPE_IQ4_NL, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_iq4_xs_m32, ES_TYPE_IQ4_XS, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_mxfp4_m32, ES_TYPE_MXFP4, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_f16_m32, ES_TYPE_F16, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_f16_m64, ES_TYPE_F16, 64)
MOE_MUL_MAT_ID(moe_mul_mat_id_bf16_m32, ES_TYPE_BF16, 32)
MOE_MUL_MAT_ID(moe_mul_mat_id_bf16_m64, ES_TYPE_BF16, 64)
MOE_MUL_MAT_ID(moe_mul_mat_id_f32_m32, ES_TYPE_F32, 32)

// ---------------------------------------------------------------------------------
// Elementwise and reduction kernels.
// ---------------------------------------------------------------------------------

extern "C" __global__ void moe_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out[t, i] = sum over k = 0..top_k-1, in that order, of weights[t, k] * y[t, k, i].
extern "C" __global__ void moe_weighted_sum(const float* __restrict__ y, const float* __restrict__ weights,
                                            float* __restrict__ out, int n_tokens, int top_k, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            acc = fmaf(weights[t * top_k + k], y[((long long)t * top_k + k) * n + i], acc);
        }
        out[(long long)t * n + i] = acc;
    }
}

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
// Stand-ins the prefill runner puts around the MoE block: a weightless RMS norm in
// place of attention and normalization, and the residual add.
// ---------------------------------------------------------------------------------

// x[t, :] = h[t, :] / sqrt(mean(h[t, :]^2) + 1e-6). One block per token; blockDim.x must be
// a power of two and the launch must give blockDim.x floats of dynamic shared memory. The
// reduction runs in a fixed order, so the result never depends on timing.
extern "C" __global__ void moe_rms_norm(const float* __restrict__ h, float* __restrict__ x, int n_tokens, int n) {
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
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        h[i] += delta[i];
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

// y[p, i] += bias[ids[p], i] for every (token, slot) pair p; pairs with an id outside
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

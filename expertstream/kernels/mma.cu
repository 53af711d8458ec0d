// mul_mat_id on matrix cores: the same grouping, tiles and results contract as the fp32
// SIMT kernel of simt.cu, with the products taken by bf16 matrix instructions and
// accumulated in fp32. This file is compiled after the shared files, as one source with them
// (their block formats, decoders, padding_tail and the grouping scratch are used here); the
// kernel instances at its end are generated from layout.FORMATS by kernel_source().
//
// Per k step of MOE_TILE_K elements a block stages the raw weight blocks of its
// MOE_TILE_N rows in shared memory (coalesced), decodes each row once with the type's
// decode_slice and rounds the values to bf16 (round to nearest even) into a shared tile;
// the activations of its TILE_M rows are rounded to bf16 the same way. Both tiles are
// double-buffered, so one step costs two barriers, and the next step's global loads are
// in flight while the matrix instructions run.
//
// The matrix step is the one vendor-specific piece, behind a small interface (MmaA,
// MmaB, MmaAcc, mma_load_a/b, mma_step, mma_row/mma_col): one wave multiplies a 16 x 16
// block of A (rows x k) by a 16 x 16 block of B (columns x k, k contiguous, as weight
// rows are stored) into a 16 x 16 block of C that its lanes hold MMA_ACC floats each of.
// Off NVIDIA the loads also take the tile's row length (mma.cu's own tiles by default) and
// mma_step_f16 multiplies f16 blocks the same way: attention.cu's matrix-core prefill uses
// them there (on NVIDIA it has a kernel of its own on mma.sync).
// It is chosen by the compiler's target macros:
// - NVIDIA sm_80 and newer: ldmatrix and two mma.sync m16n8k16 bf16 (32-lane warps);
// - AMD CDNA2/CDNA3 (gfx90a, gfx940..gfx942): one v_mfma_f32_16x16x16_bf16 (wave64), or
//   v_mfma_f32_16x16x16_f16, whose lanes hold the same elements;
// - AMD RDNA3 (gfx11) and RDNA4 (gfx12): one v_wmma_f32_16x16x16_bf16 (wave32), or its f16
//   twin, likewise;
// - anything else: plain fp32 FMAs over the same shared tiles, in logical waves of 32
//   threads, so the source compiles and runs everywhere; the launcher picks the SIMT
//   kernel of simt.cu for such devices (Capabilities.matrix_cores).
//
// Results do not depend on the tile a pair lands in: each output element is computed
// from its own activation row and weight row only, in a fixed k order, by the same
// instruction sequence whatever the other rows hold. So outputs stay byte-identical
// across groupings, ubatch sizes and tile heights on one device.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MMA_NVIDIA 1
#define MMA_WAVE 32
#elif defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define MMA_MFMA 1
#define MMA_WAVE 64
#elif defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || defined(__gfx1103__) || \
    defined(__gfx1150__) || defined(__gfx1151__) || defined(__gfx1152__)
#define MMA_WMMA_GFX11 1
#define MMA_WAVE 32
#elif defined(__gfx1200__) || defined(__gfx1201__)
#define MMA_WMMA_GFX12 1
#define MMA_WAVE 32
#else
#define MMA_GENERIC 1
#define MMA_WAVE 32  // a logical wave: the generic step uses no cross-lane operations
#endif

// Must match expertstream/kernels/layout.py.
#define MOE_MMA_THREADS 128
#define MMA_ACC (256 / MMA_WAVE)  // floats of one 16 x 16 C block per lane
#define MMA_LDK (MOE_TILE_K + 8)  // bf16 per shared tile row: 80 bytes, conflict-free for 16-byte row reads

static_assert(MOE_TILE_N == MOE_MMA_THREADS, "one thread decodes each weight row of a tile");

// ---------------------------------------------------------------------------------
// bf16 rounding (round to nearest even, NaN stays NaN), two values to a 32-bit word,
// the lower-addressed (lower k) value in the low half.
// ---------------------------------------------------------------------------------

__device__ unsigned int float_to_bf16_bits(float f) {
    const unsigned int u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16) | 0x40u;  // quiet NaN of the same sign
    }
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ unsigned int pack_bf16x2(float low, float high) {
#if defined(MMA_NVIDIA)
    unsigned int packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
#else
    return float_to_bf16_bits(low) | (float_to_bf16_bits(high) << 16);
#endif
}

// ---------------------------------------------------------------------------------
// The matrix step. a points at A[0][0] of a 16 x 16 block, b at B[0][0] (B[n][k]);
// both are shared tiles with rows of MMA_LDK bf16. C element i of lane l is
// C[mma_row(l, i)][mma_col(l, i)].
// ---------------------------------------------------------------------------------

// NVIDIA's lane arithmetic, plain integer code outside the NVIDIA block so that a host test
// checks it against the fragment layouts of the PTX ISA. ldmatrix .x4 loads four 8 x 8
// matrices, lanes 8j..8j+7 naming the rows of matrix j. For A they are rows 0-7 and 8-15 of
// k 0-7, then of k 8-15 (mma.sync's a0..a3): lane l names row l % 16 of the k half l / 16.
__device__ int ldmatrix_a_offset(int lane) {
    return (lane % 16) * MMA_LDK + (lane / 16) * 8;
}

// For B: k 0-7 and k 8-15 of columns 0-7 (b0, b1 of the first n8 step), then of columns 8-15.
__device__ int ldmatrix_b_offset(int lane) {
    return ((lane / 16) * 8 + lane % 8) * MMA_LDK + ((lane / 8) % 2) * 8;
}

// C of the two m16n8k16 steps: c0..c3 of columns 0-7, then of columns 8-15.
__device__ int mma_sync_row(int lane, int i) {
    return lane / 4 + 8 * ((i / 2) % 2);
}

__device__ int mma_sync_col(int lane, int i) {
    return (i / 4) * 8 + 2 * (lane % 4) + i % 2;
}

// AMD's lane arithmetic, plain integer code for the same reason (its host test checks it against
// the register layouts of AMD's ISA guides). On every AMD target lane l holds row l % 16 of A and
// column l % 16 of B, a run of consecutive k (from fragment_offset, in a block stored in rows of
// ld elements), and C elements of column l % 16 only; they differ in which k and which C rows.
__device__ int amd_matrix_col(int lane) {
    return lane % 16;
}

// CDNA's v_mfma_f32_16x16x16 (wave64): k 4 (l / 16) .. + 3; C rows 4 (l / 16) .. + 3.
__device__ int mfma_fragment_offset(int lane, int ld) {
    return (lane % 16) * ld + 4 * (lane / 16);
}

__device__ int mfma_row(int lane, int i) {
    return 4 * (lane / 16) + i;
}

// RDNA3's v_wmma_f32_16x16x16 (wave32): all 16 k, lanes 16-31 repeating lanes 0-15; C rows
// 2i + l / 16.
__device__ int wmma_gfx11_fragment_offset(int lane, int ld) {
    return (lane % 16) * ld;
}

__device__ int wmma_gfx11_row(int lane, int i) {
    return 2 * i + lane / 16;
}

// RDNA4's v_wmma_f32_16x16x16 (wave32): k 8 (l / 16) .. + 7; C rows i + 8 (l / 16).
__device__ int wmma_gfx12_fragment_offset(int lane, int ld) {
    return (lane % 16) * ld + 8 * (lane / 16);
}

__device__ int wmma_gfx12_row(int lane, int i) {
    return i + 8 * (lane / 16);
}

#if defined(MMA_NVIDIA)

struct MmaA {
    unsigned int r[4];
};
struct MmaB {
    unsigned int r[4];  // n 0..7 in r[0..1], n 8..15 in r[2..3]
};
struct MmaAcc {
    float v[MMA_ACC];
};

// The compiler's own conversion, which folds a constant offset from a shared pointer into the
// instruction that takes the address (an inline cvta made every copy and ldmatrix of the direct
// kernels' k loop compute its address from scratch: 14-20% of the loop's instructions).
__device__ unsigned int shared_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

__device__ void ldmatrix_x4(unsigned int* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p))
                 : "memory");
}

__device__ void mma_load_a(MmaA& a, const unsigned short* p, int lane) {
    ldmatrix_x4(a.r, p + ldmatrix_a_offset(lane));
}

__device__ void mma_load_b(MmaB& b, const unsigned short* p, int lane) {
    ldmatrix_x4(b.r, p + ldmatrix_b_offset(lane));
}

__device__ void mma_m16n8k16(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ void mma_step(MmaAcc& c, const MmaA& a, const MmaB& b) {
    mma_m16n8k16(c.v, a.r, b.r[0], b.r[1]);
    mma_m16n8k16(c.v + 4, a.r, b.r[2], b.r[3]);
}

__device__ int mma_row(int lane, int i) {
    return mma_sync_row(lane, i);
}

__device__ int mma_col(int lane, int i) {
    return mma_sync_col(lane, i);
}

#elif defined(MMA_MFMA)

typedef short mma_short4 __attribute__((ext_vector_type(4)));
typedef _Float16 mma_half4 __attribute__((ext_vector_type(4)));
typedef float mma_float4 __attribute__((ext_vector_type(4)));

// Lane l holds k 4 * (l / 16) .. + 3 of row l % 16 (A) or column l % 16 (B).
struct MmaA {
    mma_short4 v;
};
struct MmaB {
    mma_short4 v;
};
struct MmaAcc {
    mma_float4 v;
};

__device__ void mma_load_a(MmaA& a, const unsigned short* p, int lane, int ld = MMA_LDK) {
    a.v = *(const mma_short4*)(p + mfma_fragment_offset(lane, ld));
}

__device__ void mma_load_b(MmaB& b, const unsigned short* p, int lane, int ld = MMA_LDK) {
    b.v = *(const mma_short4*)(p + mfma_fragment_offset(lane, ld));
}

__device__ void mma_step(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.v, b.v, c.v, 0, 0, 0);
}

__device__ void mma_step_f16(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(mma_half4, a.v), __builtin_bit_cast(mma_half4, b.v),
                                                 c.v, 0, 0, 0);
}

__device__ int mma_row(int lane, int i) {
    return mfma_row(lane, i);
}

__device__ int mma_col(int lane, int) {
    return amd_matrix_col(lane);
}

#elif defined(MMA_WMMA_GFX11)

typedef short mma_short8 __attribute__((ext_vector_type(8)));
typedef short mma_short16 __attribute__((ext_vector_type(16)));
typedef _Float16 mma_half16 __attribute__((ext_vector_type(16)));
typedef float mma_float8 __attribute__((ext_vector_type(8)));

// Lane l holds all 16 k of row (A) or column (B) l % 16; lanes 16-31 repeat lanes 0-15.
struct MmaA {
    mma_short16 v;
};
struct MmaB {
    mma_short16 v;
};
struct MmaAcc {
    mma_float8 v;
};

// Two 16-byte reads: shared rows are 16-byte aligned, not 32.
__device__ mma_short16 load_row16(const unsigned short* row) {
    const mma_short8 low = *(const mma_short8*)row;
    const mma_short8 high = *(const mma_short8*)(row + 8);
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

__device__ void mma_load_a(MmaA& a, const unsigned short* p, int lane, int ld = MMA_LDK) {
    a.v = load_row16(p + wmma_gfx11_fragment_offset(lane, ld));
}

__device__ void mma_load_b(MmaB& b, const unsigned short* p, int lane, int ld = MMA_LDK) {
    b.v = load_row16(p + wmma_gfx11_fragment_offset(lane, ld));
}

__device__ void mma_step(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a.v, b.v, c.v);
}

__device__ void mma_step_f16(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(__builtin_bit_cast(mma_half16, a.v),
                                                     __builtin_bit_cast(mma_half16, b.v), c.v);
}

__device__ int mma_row(int lane, int i) {
    return wmma_gfx11_row(lane, i);
}

__device__ int mma_col(int lane, int) {
    return amd_matrix_col(lane);
}

#elif defined(MMA_WMMA_GFX12)

typedef short mma_short8 __attribute__((ext_vector_type(8)));
typedef _Float16 mma_half8 __attribute__((ext_vector_type(8)));
typedef float mma_float8 __attribute__((ext_vector_type(8)));

// Lane l holds k 8 * (l / 16) .. + 7 of row (A) or column (B) l % 16.
struct MmaA {
    mma_short8 v;
};
struct MmaB {
    mma_short8 v;
};
struct MmaAcc {
    mma_float8 v;
};

__device__ void mma_load_a(MmaA& a, const unsigned short* p, int lane, int ld = MMA_LDK) {
    a.v = *(const mma_short8*)(p + wmma_gfx12_fragment_offset(lane, ld));
}

__device__ void mma_load_b(MmaB& b, const unsigned short* p, int lane, int ld = MMA_LDK) {
    b.v = *(const mma_short8*)(p + wmma_gfx12_fragment_offset(lane, ld));
}

__device__ void mma_step(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(a.v, b.v, c.v);
}

__device__ void mma_step_f16(MmaAcc& c, const MmaA& a, const MmaB& b) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(__builtin_bit_cast(mma_half8, a.v),
                                                           __builtin_bit_cast(mma_half8, b.v), c.v);
}

__device__ int mma_row(int lane, int i) {
    return wmma_gfx12_row(lane, i);
}

__device__ int mma_col(int lane, int) {
    return amd_matrix_col(lane);
}

#else  // MMA_GENERIC

// The fragments are the shared blocks themselves; lane l computes column l % 16 of the
// rows 2i + l / 16 with fp32 FMAs in k order.
struct MmaA {
    const unsigned short* p;
    int ld;
};
struct MmaB {
    const unsigned short* p;
    int ld;
};
struct MmaAcc {
    float v[MMA_ACC];
};

__device__ void mma_load_a(MmaA& a, const unsigned short* p, int, int ld = MMA_LDK) {
    a.p = p;
    a.ld = ld;
}

__device__ void mma_load_b(MmaB& b, const unsigned short* p, int, int ld = MMA_LDK) {
    b.p = p;
    b.ld = ld;
}

__device__ int mma_row(int lane, int i) {
    return 2 * i + lane / 16;
}

__device__ int mma_col(int lane, int) {
    return lane % 16;
}

__device__ float mma_generic_value(unsigned short v, bool f16) {
    return f16 ? half_to_float(v) : bf16_to_float(v);
}

__device__ void mma_generic_step(MmaAcc& c, const MmaA& a, const MmaB& b, bool f16) {
    const int lane = threadIdx.x % MMA_WAVE;
#pragma unroll
    for (int i = 0; i < MMA_ACC; ++i) {
        const unsigned short* a_row = a.p + mma_row(lane, i) * a.ld;
        const unsigned short* b_row = b.p + mma_col(lane, i) * b.ld;
        for (int k = 0; k < 16; ++k) {
            c.v[i] = fmaf(mma_generic_value(a_row[k], f16), mma_generic_value(b_row[k], f16), c.v[i]);
        }
    }
}

__device__ void mma_step(MmaAcc& c, const MmaA& a, const MmaB& b) {
    mma_generic_step(c, a, b, false);
}

__device__ void mma_step_f16(MmaAcc& c, const MmaA& a, const MmaB& b) {
    mma_generic_step(c, a, b, true);
}

#endif

// ---------------------------------------------------------------------------------
// The kernel: TILE_M pairs x MOE_TILE_N outputs per block of MOE_MMA_THREADS threads.
// Waves are laid out WAVES_M x WAVES_N over the tile; each owns SUB_M x SUB_N blocks of
// 16 x 16 (SUB_M = 2: 32 rows per wave).
// ---------------------------------------------------------------------------------

template <int TYPE, int TILE_M>
__device__ void mul_mat_id_mma_tile(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                    const int* __restrict__ scratch, float* __restrict__ y, int n_expert,
                                    int n_out, int n_in, int top_k, int x_per_pair, int max_tiles) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    const int BLOCK_BYTES = BlockFormat<TYPE>::bytes;
    const int ROW_WORDS = (UNITS * (int)sizeof(Unit) + 3) / 4;
    const int RAW_STRIDE = (ROW_WORDS | 1) * 4 / (int)sizeof(Unit);  // odd words per row: no bank conflicts
    const int WAVES = MOE_MMA_THREADS / MMA_WAVE;
    const int WAVES_M = TILE_M / 32 < WAVES ? TILE_M / 32 : WAVES;
    const int WAVES_N = WAVES / WAVES_M;
    const int SUB_M = TILE_M / 16 / WAVES_M;
    const int SUB_N = MOE_TILE_N / 16 / WAVES_N;
    const int X_VECS = TILE_M * (MOE_TILE_K / 4) / MOE_MMA_THREADS;  // 4-float groups per thread and step

    __shared__ __attribute__((aligned(16))) unsigned short x_tile[2][TILE_M * MMA_LDK];
    __shared__ __attribute__((aligned(16))) unsigned short w_tile[2][MOE_TILE_N * MMA_LDK];
    __shared__ Unit raw[MOE_TILE_N * RAW_STRIDE];
    __shared__ int src_row[TILE_M];
    __shared__ int dst_row[TILE_M];
    __shared__ float tail[MOE_TILE_N];

    const int expert = begin_tile<TILE_M, MOE_MMA_THREADS>(scratch, y, src_row, dst_row, n_expert, n_out, top_k,
                                                            x_per_pair, max_tiles);
    if (expert < 0) {
        return;
    }
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * MOE_TILE_N;
    const long long row_bytes = weight_row_bytes<TYPE>(n_in);
    const unsigned char* w_expert = w + (long long)expert * n_out * row_bytes;
    const int expert_row_bytes = (int)row_bytes;
    const int k_steps = (n_in + MOE_TILE_K - 1) / MOE_TILE_K;
    // Activations are read four floats at a time where rows are 16-byte aligned.
    const bool x_vectors = (n_in % 4) == 0 && ((unsigned long long)x % 16) == 0;

    tail[tid] = n0 + tid < n_out ? padding_tail<TYPE>(w_expert + (long long)(n0 + tid) * row_bytes, n_in) : 0.0f;

    const int wave = tid / MMA_WAVE;
    const int lane = tid % MMA_WAVE;
    const int wave_m = wave % WAVES_M;
    const int wave_n = wave / WAVES_M;
    MmaAcc acc[SUB_M][SUB_N];
#pragma unroll
    for (int i = 0; i < SUB_M; ++i) {
#pragma unroll
        for (int j = 0; j < SUB_N; ++j) {
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) {
                acc[i][j].v[e] = 0.0f;
            }
        }
    }

    // One k step's global data, staged in registers: thread tid holds staged unit
    // tid + r * MOE_MMA_THREADS of the raw weight tile (consecutive threads read
    // consecutive units of a row: coalesced) and the 4-float group tid + r * threads of
    // the activation tile (row g / 8, columns 4 * (g % 8) ..). Where each comes from is
    // fixed over k and computed once. Weight rows past n_out and the activation rows of a
    // tile's empty slots read row n_out - 1 and the tile's first pair instead: a product
    // lands only in the output of its own weight row and activation row, and those outputs
    // are never stored.
    int raw_from[UNITS];  // byte offset in the expert: the row, and for one-slice blocks the unit
#pragma unroll
    for (int r = 0; r < UNITS; ++r) {
        const int i = tid + r * MOE_MMA_THREADS;
        const int n = i / UNITS;
        const int row = n0 + n < n_out ? n0 + n : n_out - 1;
        raw_from[r] = row * expert_row_bytes + (SLICES == 1 ? (i - n * UNITS) * (int)sizeof(Unit) : 0);
    }
    const float* x_from[X_VECS];
#pragma unroll
    for (int r = 0; r < X_VECS; ++r) {
        const int m = tid / (MOE_TILE_K / 4) + r * (MOE_MMA_THREADS / (MOE_TILE_K / 4));
        const int src = src_row[m] >= 0 ? src_row[m] : src_row[0];
        x_from[r] = x + (long long)src * n_in + 4 * (tid % (MOE_TILE_K / 4));
    }
    // Staged units are packed into 32-bit registers (two 16-bit units, four bytes): they are
    // held across the matrix step, where registers are scarce.
    const int UNIT_BITS = 8 * (int)sizeof(Unit);
    const int PER_WORD = 32 / UNIT_BITS;
    unsigned int raw_regs[(UNITS + PER_WORD - 1) / PER_WORD];
    vec4 x_regs[X_VECS];
    auto load_step = [&](int ks) {
        const int k0 = ks * MOE_TILE_K;
        const unsigned char* w_step = w_expert + (ks / SLICES) * BLOCK_BYTES;
        // Quantized rows hold whole blocks; a float row's last step may be partial.
        const bool full_step = BlockFormat<TYPE>::quantized || k0 + MOE_TILE_K <= n_in;
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int h = (tid + r * MOE_MMA_THREADS) % UNITS;
            const int at = SLICES == 1 ? raw_from[r]
                                       : raw_from[r] + BlockFormat<TYPE>::unit_of(ks % SLICES, h) * (int)sizeof(Unit);
            const unsigned int unit = full_step || k0 + h < n_in ? *(const Unit*)(w_step + at) : (Unit)0;
            if (r % PER_WORD == 0) {
                raw_regs[r / PER_WORD] = unit;
            } else {
                raw_regs[r / PER_WORD] |= unit << (UNIT_BITS * (r % PER_WORD));
            }
        }
#pragma unroll
        for (int r = 0; r < X_VECS; ++r) {
            const float* at = x_from[r] + k0;
            vec4 v;
            if (full_step && x_vectors) {
                v = *(const vec4*)at;
            } else {
                const int k = k0 + 4 * (tid % (MOE_TILE_K / 4));
                v.x = k < n_in ? at[0] : 0.0f;
                v.y = k + 1 < n_in ? at[1] : 0.0f;
                v.z = k + 2 < n_in ? at[2] : 0.0f;
                v.w = k + 3 < n_in ? at[3] : 0.0f;
            }
            x_regs[r] = v;
        }
    };
    auto store_step = [&](int buf) {
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int i = tid + r * MOE_MMA_THREADS;
            const int n = i / UNITS;
            raw[n * RAW_STRIDE + i - n * UNITS] = (Unit)(raw_regs[r / PER_WORD] >> (UNIT_BITS * (r % PER_WORD)));
        }
#pragma unroll
        for (int r = 0; r < X_VECS; ++r) {
            const int g = tid + r * MOE_MMA_THREADS;
            unsigned int* at =
                (unsigned int*)(x_tile[buf] + (g / (MOE_TILE_K / 4)) * MMA_LDK + 4 * (g % (MOE_TILE_K / 4)));
            at[0] = pack_bf16x2(x_regs[r].x, x_regs[r].y);
            at[1] = pack_bf16x2(x_regs[r].z, x_regs[r].w);
        }
    };

    load_step(0);
    for (int ks = 0; ks < k_steps; ++ks) {
        const int buf = ks & 1;
        // Writes into buffer buf: the matrix step two k steps back read it, and two
        // barriers have passed since.
        store_step(buf);
        __syncthreads();
        {
            float v[32];
            decode_slice<TYPE>(raw + tid * RAW_STRIDE, ks % SLICES, v);
            unsigned int* row = (unsigned int*)(w_tile[buf] + tid * MMA_LDK);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                row[j] = pack_bf16x2(v[2 * j], v[2 * j + 1]);
            }
        }
        if (ks + 1 < k_steps) {
            load_step(ks + 1);  // in flight during the matrix step
        }
        __syncthreads();
        const unsigned short* x_base = x_tile[buf] + (wave_m * SUB_M * 16) * MMA_LDK;
        const unsigned short* w_base = w_tile[buf] + (wave_n * SUB_N * 16) * MMA_LDK;
#pragma unroll
        for (int kk = 0; kk < MOE_TILE_K; kk += 16) {
            MmaA a[SUB_M];
            MmaB b[SUB_N];
#pragma unroll
            for (int i = 0; i < SUB_M; ++i) {
                mma_load_a(a[i], x_base + i * 16 * MMA_LDK + kk, lane);
            }
#pragma unroll
            for (int j = 0; j < SUB_N; ++j) {
                mma_load_b(b[j], w_base + j * 16 * MMA_LDK + kk, lane);
            }
#pragma unroll
            for (int i = 0; i < SUB_M; ++i) {
#pragma unroll
                for (int j = 0; j < SUB_N; ++j) {
                    mma_step(acc[i][j], a[i], b[j]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < SUB_M; ++i) {
#pragma unroll
        for (int j = 0; j < SUB_N; ++j) {
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) {
                const int m = (wave_m * SUB_M + i) * 16 + mma_row(lane, e);
                const int n = (wave_n * SUB_N + j) * 16 + mma_col(lane, e);
                const int p = dst_row[m];
                if (p >= 0 && n0 + n < n_out) {
                    y[(long long)p * n_out + n0 + n] = acc[i][j].v[e] + tail[n];
                }
            }
        }
    }
}

#define MOE_MUL_MAT_ID_MMA(NAME, TYPE, TILE_M)                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_MMA_THREADS)                                         \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x,                           \
             const int* __restrict__ scratch, float* __restrict__ y, int n_expert, int n_out, int n_in,   \
             int top_k, int x_per_pair, int max_tiles) {                                                  \
        KERNEL_PROLOGUE();                                                                                \
        mul_mat_id_mma_tile<TYPE, TILE_M>(w, x, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair,    \
                                          max_tiles);                                                     \
    }

// Mixture-of-Experts kernels: one source for NVRTC (CUDA) and hipRTC (HIP), kept in several
// files that program.py concatenates in a fixed order (SOURCE_NAMES) into one translation unit:
// each file uses what the files before it define. This first one holds the type numbers, the
// constants shared with layout.py, the block layouts and the value tables.
//
// Portability rules every file keeps:
// - no includes: f16 and bf16 are decoded from their bits by hand;
// - no warp-level intrinsics on the portable paths: every cooperation goes through shared
//   memory and __syncthreads, so the code is correct for any wavefront size (32 on NVIDIA,
//   64 on most AMD GPUs); NVIDIA-only paths (under __CUDA_ARCH__, such as the router's
//   warp selection) may shuffle, and write the bytes of the portable path they stand for;
// - explicit fmaf, so both compilers accumulate with the same contraction.
//
// Weight layouts are ggml's (ggml-common.h): a 3-D expert tensor [n_expert][n_out][n_in]
// of rows of n_in elements, contiguous, each row a run of blocks. The matrix kernel steps
// k by 32 elements: one block of the 32-element types, one slice of the 256-element ones
// (K-quants, i-quants), which it decodes with the block's shared scales.

// Chained launches (NVIDIA sm_90+, programmatic dependent launch): a kernel launched chained to
// the kernel before it in its stream may be scheduled while that one still runs. Every kernel
// opens with KERNEL_PROLOGUE: griddepcontrol.wait holds it until the kernels it depends on have
// finished and their writes are visible, then launch_dependents lets the next kernel be scheduled
// in turn, so its launch overlaps this one's work. A kernel launched unchained passes through
// both at once; elsewhere the macro is empty.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP_PLATFORM_AMD__)
#define KERNEL_PROLOGUE() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define KERNEL_PROLOGUE() ((void)0)
#endif

// A hint that the 128-byte line holding p is wanted soon: NVIDIA fetches it into L2, where every write
// lands too, so it may be issued before KERNEL_PROLOGUE's wait and can never make a read stale (a
// weight read later comes from L2 instead of DRAM). Elsewhere nothing.
#if defined(__CUDA_ARCH__) && !defined(__HIP_PLATFORM_AMD__)
#define PREFETCH_L2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#else
#define PREFETCH_L2(p) ((void)(p))
#endif

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
#define ES_TYPE_IQ2_XXS 16
#define ES_TYPE_IQ2_XS 17
#define ES_TYPE_IQ3_XXS 18
#define ES_TYPE_IQ1_S 19
#define ES_TYPE_IQ4_NL 20
#define ES_TYPE_IQ3_S 21
#define ES_TYPE_IQ2_S 22
#define ES_TYPE_IQ4_XS 23
#define ES_TYPE_IQ1_M 29
#define ES_TYPE_BF16 30
#define ES_TYPE_MXFP4 39

// Must match expertstream/kernels/layout.py.
#define MOE_MAX_EXPERTS 1024      // buckets in the grouping kernel (plus one for bad ids)
#define MOE_SCRATCH_HEADER 4      // ints before the tile table
#define MOE_TILE_N 128            // outputs per block in mul_mat_id
#define MOE_TILE_K 32             // elements per k step: one block or one 32-element slice
#define MOE_ROW_PADDING 512       // quantized rows are read in blocks of this many elements
#define MOE_MMID_THREADS 128
#define MOE_GROUP_THREADS 256
#define MOE_GROUP_CHUNK 2048      // pairs per grouping block
#define ROUTER_MAX_EXPERTS 512
#define ROUTER_MAX_K 32

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

__device__ unsigned int float_to_bits(float f) {
    union {
        float f;
        unsigned int u;
    } v;
    v.f = f;
    return v.u;
}

// (float)(q - bias) for 0 <= q, bias < 2^23, exactly, without a conversion instruction: q in the
// mantissa of a float of exponent 23 is 2^23 + q, and subtracting 2^23 + bias leaves the integer q - bias,
// which a float holds exactly. NVIDIA's multiprocessors convert integers at a quarter of their float
// rate, and the decoders make one value per weight: this costs a logic and a float operation.
__device__ float small_float(unsigned int q, int bias) {
    return bits_to_float(0x4b000000u | q) - (float)(8388608 + bias);
}

// silu(g) * u, SwiGLU's product: the one expression every kernel that writes it uses, so their bytes agree.
__device__ float silu_times(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
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

// The i-quants IQ1_S .. IQ3_S: eight 32-element sub-blocks, each element a point of a
// lattice grid (the tables below), with signs and a scale per sub-block. Slice s stages
// the block's f16 scale and the grid indices, signs and scale bits of sub-block s.

// IQ1_S: d qs[32] qh[8 x 16 bits]. Slice s: d, its 4 index bytes, qh[s].
template <> struct BlockFormat<ES_TYPE_IQ1_S> {
    typedef unsigned short Unit;
    static const int bytes = 50;
    static const int slices = 8;
    static const int slice_units = 4;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 3 ? 2 * s + h : 17 + s); }
};

// IQ1_M: qs[32] qh[16] scales[4 x 16 bits], the f16 scale spread over the top nibbles of
// the four scale words. Slice s: its 4 index bytes, its 2 qh bytes, all four scale words.
template <> struct BlockFormat<ES_TYPE_IQ1_M> {
    typedef unsigned short Unit;
    static const int bytes = 56;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 2 ? 2 * s + h : (h == 2 ? 16 + s : 24 + h - 3); }
};

// IQ2_XXS: d qs[64]; sub-block s is 4 index bytes then a 32-bit word of four 7-bit sign
// indices and a 4-bit scale. Slice s: d and those 8 bytes.
template <> struct BlockFormat<ES_TYPE_IQ2_XXS> {
    typedef unsigned short Unit;
    static const int bytes = 66;
    static const int slices = 8;
    static const int slice_units = 5;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : 4 * s + h; }
};

// IQ2_XS: d qs[32 x 16 bits: 9-bit index, 7-bit sign index] scales[8]. Slice s: d, its
// four index words, the scale pair in byte s.
template <> struct BlockFormat<ES_TYPE_IQ2_XS> {
    typedef unsigned short Unit;
    static const int bytes = 74;
    static const int slices = 8;
    static const int slice_units = 6;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 5 ? 4 * s + h : 33 + (s >> 1)); }
};

// IQ2_S: d qs[32] signs[32] qh[8] scales[8]. Slice s: d, its 4 index bytes, its 4 sign
// bytes, qh[s] (2 high index bits each) and the scale pair in scales[s].
template <> struct BlockFormat<ES_TYPE_IQ2_S> {
    typedef unsigned short Unit;
    static const int bytes = 82;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        if (h < 3) {
            return h == 0 ? 0 : 2 * s + h;
        }
        return h < 5 ? 17 + 2 * s + h - 3 : (h == 5 ? 33 + (s >> 1) : 37 + (s >> 1));
    }
};

// IQ3_XXS: d qs[64] scales_signs[8 x 32 bits]. Slice s: d, its 8 index bytes, its word of
// four 7-bit sign indices and a 4-bit scale.
template <> struct BlockFormat<ES_TYPE_IQ3_XXS> {
    typedef unsigned short Unit;
    static const int bytes = 98;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 5 ? 4 * s + h : 33 + 2 * s + h - 5); }
};

// IQ3_S: d qs[64] qh[8] signs[32] scales[4]. Slice s: d, its 8 index bytes, qh[s] (the
// 9th index bits), its 4 sign bytes and the scale nibble s of scales.
template <> struct BlockFormat<ES_TYPE_IQ3_S> {
    typedef unsigned short Unit;
    static const int bytes = 110;
    static const int slices = 8;
    static const int slice_units = 9;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        if (h < 5) {
            return h == 0 ? 0 : 4 * s + h;
        }
        return h == 5 ? 33 + (s >> 1) : (h < 8 ? 37 + 2 * s + h - 6 : 53 + (s >> 2));
    }
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

// mul_mat_id with the weights decoded straight into matrix fragments, for the types whose quants of
// four consecutive elements lie in one 32-bit word, where NVIDIA's mma.sync m16n8k16 B fragments
// want them (Q4_0, Q4_K, MXFP4; Q6_K's in one word of low bits and one of high bits). Compiled
// after the shared files, mma.cu and int8.cu as one source with them (block formats, padding_tail,
// begin_tile, weight_row_bytes, pack_bf16x2, the bf16 fragment helpers); the instances at the end
// are generated from layout.FORMATS by kernel_source().
//
// The shared-tile kernels of mma.cu decode each weight row into a bf16 tile in shared memory and
// then read it back into fragments: two barriers per 32 elements of k, every decoded weight
// passing through shared memory. Here each lane decodes the four weights of its own B fragment
// from one 32-bit word of quants (two for Q6_K), and no decoded weight is stored:
//
// - moe_round_x_direct, once per call, rounds the activations to bf16 (nearest even, as the
//   shared-tile kernels round them) and writes each 16-element chunk of a row in fragment
//   order: its 32-bit words (element pairs) 0..7 go to word positions 0, 4, 1, 5, 2, 6, 3, 7.
//   Fragment slots 2c, 2c+1, 2c+8, 2c+9 of a chunk (lane c = lane % 4) then hold elements
//   4c .. 4c+3, the four consecutive elements whose nibbles lie in one 32-bit word of a Q4_0
//   or Q4_K block (whose low nibbles and high bits lie in one ql and one qh word of a Q6_K block):
//   a lane reads one word per chunk pair (two per chunk pair for Q6_K) and never shuffles.
// - Warp w owns weight rows 32w .. 32w+31 of the block's 128 in four n8 groups, and all TILE_M
//   activation rows, so each weight is decoded exactly once per block.
// - Per k step of DIRECT_K = 64 elements the block copies the step's activation rows (TILE_M x
//   64 bf16, 16-byte copies into a swizzled tile) and each warp the step's raw bytes of its own
//   32 weight rows (coalesced 4-byte copies) into shared memory: cp.async on sm_80+,
//   double-buffered, so the next step's copies run during this step's products, one barrier
//   per step. Q6_K's 210-byte blocks put rows and blocks 2 bytes past a 4-byte boundary by
//   turns: its words are copied from the boundary below and shifted into place when decoded.
// - A weight is decoded with the float32 operations of decode_slice (the same values as the
//   shared-tile kernels), rounded to bf16 and multiplied on the matrix unit with float32
//   accumulation, k steps ascending and the four chunks of a step in k order (a Q6_K step takes
//   two 32-element runs of its block 64 elements apart, see Direct<ES_TYPE_Q6_K>).
//
// Results do not depend on the tile a pair lands in: an output is the sum of its own
// activation row times its own weight row, by the same instruction sequence whatever the
// other rows of the tile hold, so outputs are byte-identical across groupings and tile heights.
//
// Two epilogues besides the plain product:
// - gate and up in one pass (GATE_UP): groups 0-1 of a warp hold 16 rows of the gate
//   tensor and groups 2-3 the same 16 rows of the up tensor, so a lane holds the gate and up
//   value of the same output and writes silu(gate) * up, with moe_swiglu's float operations;
//   a block covers 64 outputs.
// - the down projection scaled by each pair's routing weight (route_weights): y = w[p] * (W x),
//   the multiplication combine would otherwise do, which then only adds the top-k outputs up.
//
// On other targets (and in the host test harness) the fragments are read from shared memory
// lane by lane and the matrix step is taken by fp32 FMAs through a per-warp exchange in shared
// memory, so the source compiles and runs everywhere; the launcher picks these kernels only
// where Capabilities.mma_fragments is set (NVIDIA sm_80+).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DIRECT_NVIDIA 1
#define DIRECT_UNROLL _Pragma("unroll")
#else
#define DIRECT_GENERIC 1
#define DIRECT_UNROLL  // the generic matrix step holds barriers, which loops around it cannot be unrolled over
#endif

// NVIDIA before sm_80 has no bf16 mma.sync, and the launcher never picks these kernels there. Each
// is an entry that traps, so that a module holds the same kernels on every architecture: with the
// generic step's exchange, Q4_K's 128-pair tile needs more than sm_75's 48 KiB of shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DIRECT_TRAPS 1
#endif

// Must match expertstream/kernels/layout.py.
#define MOE_DIRECT_THREADS 128
#define DIRECT_K 64                 // elements per k step
#define DIRECT_WARPS (MOE_DIRECT_THREADS / 32)
#define DIRECT_GROUPS 4             // n8 groups per warp: 32 weight rows
#define DIRECT_ROUND_THREADS 256

// The direct kernels' launch bounds: their threads and, on NVIDIA, the blocks per multiprocessor the
// compiler keeps registers for (0: no bound). Q4_K's 64-pair kernels took 178 registers (two
// blocks); held to three blocks' worth (168, spilling 24-32 bytes) they ran 1.05-1.17x faster on the
// H200. Q4_0's fit three blocks as they are, and ran 1-2% slower when held. Q6_K's 64-pair kernels
// fit three blocks as they are too (168 registers, no spills, from CUDA 13.0's ptxas for sm_90).
#if defined(DIRECT_NVIDIA)
#define DIRECT_BOUNDS(TYPE, TILE_M) MOE_DIRECT_THREADS, ((TYPE) == ES_TYPE_Q4_K && (TILE_M) == 64 ? 3 : 0)
#else
#define DIRECT_BOUNDS(TYPE, TILE_M) MOE_DIRECT_THREADS
#endif

static_assert(DIRECT_WARPS * DIRECT_GROUPS * 8 == MOE_TILE_N, "a block covers MOE_TILE_N weight rows");
static_assert((MOE_DIRECT_THREADS / (DIRECT_K / 8)) % 8 == 0, "a thread's activation rows share a swizzle");

// Word position of element pair i (0..7) of a 16-element chunk in fragment order.
__device__ int direct_pair_slot(int i) {
    return (i % 2) * 4 + i / 2;
}

// xb = x rounded to bf16 with every 16-element chunk in fragment order; rows of n_in elements,
// n_in a multiple of DIRECT_K. One thread per output word.
extern "C" __global__ void __launch_bounds__(DIRECT_ROUND_THREADS)
    moe_round_x_direct(const float* __restrict__ x, unsigned int* __restrict__ xb, int n_rows, int n_in) {
    KERNEL_PROLOGUE();
    const long long words = (long long)n_rows * (n_in / 2);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        const long long chunk = i / 8;  // 8 words per chunk, chunks never straddle rows
        const int pair = (int)(i % 8);
        const float* from = x + 2 * i;
        xb[chunk * 8 + direct_pair_slot(pair)] = pack_bf16x2(from[0], from[1]);
    }
}

// ---------------------------------------------------------------------------------
// Per-type fragment decoding. A warp stages, per k step, STEP_WORDS 32-bit words of each of its
// 32 weight rows in shared memory, in GROUPS groups: group i is words FIRST[i] .. FIRST[i + 1] - 1,
// word w of it from byte 4 w + step(ks, i) of the row. Parts of a block that move differently from
// step to step (Q4_K's header and its quants) are groups of their own, each copied by copies that all
// add one value per step. Where rows are not whole words (Q6_K, not ALIGNED) each word is copied from
// the 4-byte boundary at or below its byte, and the decoders shift the words down by the 2 bytes a
// block may start past it.
// The step's activations are elements x_at(ks) + x_part(h) .. + 7 of a row for the tile's 16-byte
// parts h = 0..7 (64 consecutive elements but for Q6_K).
// decode(row, c, ks, prep, part, b) turns the staged words of one row into lane c's B fragments
// of chunks 2 part and 2 part + 1 of step ks's four 16-element chunks: b[0], b[1] are the (b0, b1)
// registers of the first, b[2], b[3] of the second. With SPLIT the kernel decodes and multiplies
// half a step at a time (fewer fragment registers, and the second half's decoding can overlap the
// first half's products); without, the whole step's fragments first.
// ---------------------------------------------------------------------------------

template <int TYPE> struct Direct;

// What a decoder needs of a row per step besides its quants (Prep: Q4_K the two sub-blocks' scales
// and mins, Q6_K the four chunks' scales). Four lanes decode each row, so one lane per row works it
// out (prepare, given where the row starts past a 4-byte boundary) and leaves it in shared memory for
// them, instead of all four working it out alike.
struct __attribute__((aligned(16))) DirectPrep {
    float scale[2];
    float min[2];
};

// What the types whose step is 64 consecutive elements of rows of whole words share.
struct DirectContiguous {
    typedef DirectPrep Prep;
    static const bool ALIGNED = true;
    __device__ static int x_at(int ks) {
        return DIRECT_K * ks;
    }
    __device__ static int x_part(int part) {
        return 8 * part;
    }
};

// (h & mask) | 0x4B000000 in one instruction. Written as C, both constants are immediates, and
// the compiler then spends two integer operations on it (a logic operation takes one immediate);
// here the exponent bits come from a register. The integer unit bounds these kernels: on the
// H200 its pipe was the busiest (43-55% of its peak, the tensor pipe's 5% at ubatch 512).
template <unsigned int MASK>
__device__ unsigned int mask_with_exponent(unsigned int h) {
#if defined(DIRECT_NVIDIA)
    unsigned int exponent;
    asm("mov.b32 %0, 0x4B000000;" : "=r"(exponent));
    unsigned int out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(h), "n"(MASK), "r"(exponent));  // (a & b) | c
    return out;
#else
    return (h & MASK) | 0x4B000000u;
#endif
}

// The low nibble of h as a float without an integer-to-float conversion (a slow unit): 2^23 + the
// nibble, built by one mask-and-or, minus 2^23, both exact.
__device__ float low_nibble_to_float(unsigned int h) {
    return bits_to_float(mask_with_exponent<0xFu>(h)) - 8388608.0f;
}

// Nibble p (0..3) of the low 16 bits of h, in place, as a float without an integer-to-float
// conversion (a slow unit): 2^23 + 2^(4p) nibble, built by one mask-and-or (no shift). It is
// exact, and so is subtracting 2^23 + 2^(4p) k from it; multiplied by a scale times 2^(-4p) (exact
// too) it gives the value the shifted nibble would. The high 16 bits of a word go through the
// same after one shift, so a word of eight nibbles costs nine integer operations.
template <int P>
__device__ float nibble_in_place(unsigned int h) {
    return bits_to_float(mask_with_exponent<(0xFu << (4 * P))>(h));
}

__device__ float pow2_minus_4p(int p) {  // 2^(-4p)
    return p == 0 ? 1.0f : p == 1 ? 0.0625f : p == 2 ? 0.00390625f : 0.000244140625f;
}

// Two 32-element blocks per step (36 bytes, 4-byte aligned: rows hold whole pairs of blocks): d,
// then qs[16] whose byte j holds element j (low nibble) and j + 16 (high). Lane c takes qs bytes
// 4c .. 4c+3 of each block: elements 4c .. 4c+3 (chunk 2 blk) and 16 + 4c .. (chunk 2 blk + 1).
template <> struct Direct<ES_TYPE_Q4_0> : DirectContiguous {
    static const int STEP_WORDS = 9;
    static const bool PREPARES = false;
    static const bool SPLIT = true;
    static const int GROUPS = 1;
    static constexpr int FIRST[GROUPS + 1] = {0, STEP_WORDS};
    __device__ static int step(int ks, int) {
        return 36 * ks;
    }
    __device__ static void prepare(const unsigned int*, int, unsigned int, DirectPrep*) {}
    // 0 times a block's scale: +0 when it is finite, and then so is every value of the block.
    __device__ static float zero_times_scales(const unsigned char* block) {
        return 0.0f * half_to_float(*(const unsigned short*)block);
    }
    // Block `part` of the step gives chunks 2 part (low nibbles) and 2 part + 1 (high).
    __device__ static void decode(const unsigned int* row, int c, int, const DirectPrep&, int blk,
                                  unsigned int* b) {
        // Block 0 starts at byte 0 (d in the low half of word 0, qs from byte 2), block 1 at byte
        // 18 (d in the high half of word 4, qs from byte 20: word 5).
        const float d = half_to_float(blk == 0 ? row[0] & 0xffffu : row[4] >> 16);
        const unsigned int q = blk == 0 ? (row[c] >> 16) | (row[c + 1] << 16) : row[5 + c];
        // Byte i: nibble 2 (i % 2) (low) and 2 (i % 2) + 1 (high) of half i / 2 of q.
        // d (q - 8) = d 2^(-4p) ((2^23 + 2^(4p) q) - (2^23 + 2^(4p) 8)), every step exact.
        float scale[4];
        float offset[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            scale[p] = d * pow2_minus_4p(p);
            offset[p] = 8388608.0f + 8.0f / pow2_minus_4p(p);
        }
        float lo[4];
        float hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int h = i < 2 ? q : q >> 16;
            if (i % 2 == 0) {
                lo[i] = scale[0] * (nibble_in_place<0>(h) - offset[0]);
                hi[i] = scale[1] * (nibble_in_place<1>(h) - offset[1]);
            } else {
                lo[i] = scale[2] * (nibble_in_place<2>(h) - offset[2]);
                hi[i] = scale[3] * (nibble_in_place<3>(h) - offset[3]);
            }
        }
        b[0] = pack_bf16x2(lo[0], lo[1]);
        b[1] = pack_bf16x2(lo[2], lo[3]);
        b[2] = pack_bf16x2(hi[0], hi[1]);
        b[3] = pack_bf16x2(hi[2], hi[3]);
    }
};

// One 64-element group g = ks % 4 of a 256-element block per step. Staged: the block's d, dmin and
// scales[12] (words 0-3), then the group's 32 qs bytes (words 4-11), whose byte l holds element
// 64g + l (low nibble, sub-block 2g) and 64g + 32 + l (high, sub-block 2g + 1). Lane c takes
// words 4 + c (chunks 0 and 2) and 8 + c (chunks 1 and 3).
template <> struct Direct<ES_TYPE_Q4_K> : DirectContiguous {
    static const int STEP_WORDS = 12;
    static const bool PREPARES = true;
    static const bool SPLIT = false;
    // Words 0-3 are the block's header, words 4-11 the group's quants at 16 + 32 g: byte 4 w either way
    // but for the group's 32 g.
    static const int GROUPS = 2;
    static constexpr int FIRST[GROUPS + 1] = {0, 4, STEP_WORDS};
    __device__ static int step(int ks, int group) {
        return (ks / 4) * 144 + (group == 1 ? 32 * (ks % 4) : 0);
    }
    // 0 times a block's d and dmin: +0 when both are finite, and then so is every value of the block.
    __device__ static float zero_times_scales(const unsigned char* block) {
        const unsigned int dm = *(const unsigned int*)block;
        return 0.0f * half_to_float(dm & 0xffffu) + 0.0f * half_to_float(dm >> 16);
    }
    __device__ static int scale_byte(const unsigned int* row, int i) {
        return (int)((row[1 + i / 4] >> (8 * (i % 4))) & 0xffu);
    }
    // k4_scale_min's arithmetic on the staged scales.
    __device__ static void scale_min(const unsigned int* row, int j, int* sc, int* m) {
        if (j < 4) {
            *sc = scale_byte(row, j) & 63;
            *m = scale_byte(row, j + 4) & 63;
        } else {
            const int high = scale_byte(row, j + 4);
            *sc = (high & 0xf) | ((scale_byte(row, j - 4) >> 6) << 4);
            *m = (high >> 4) | ((scale_byte(row, j) >> 6) << 4);
        }
    }
    // Sub-blocks 2g and 2g + 1: d * scale and dmin * min of each.
    __device__ static void prepare(const unsigned int* row, int ks, unsigned int, DirectPrep* prep) {
        const int group = ks % 4;
        const float d = half_to_float(row[0] & 0xffffu);
        const float dmin = half_to_float(row[0] >> 16);
        DirectPrep out;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int sc;
            int m;
            scale_min(row, 2 * group + half, &sc, &m);
            out.scale[half] = d * (float)sc;
            out.min[half] = dmin * (float)m;
        }
        *prep = out;
    }
    // Sub-block 2g + half (the low nibbles, then the high) gives chunks 2 half and 2 half + 1. The
    // nibbles are shifted down: taken in place (as Q4_0's are), and with the step decoded half at a
    // time, the 128-pair kernels spilled more and ran up to 8% slower on the H200
    // (docs/results/cuda-h200-kernels.md).
    __device__ static void decode(const unsigned int* row, int c, int, const DirectPrep& prep, int half,
                                  unsigned int* b) {
        const float d = prep.scale[half];
        const float dm = prep.min[half];
#pragma unroll
        for (int word = 0; word < 2; ++word) {  // chunk 2 * half + word
            const unsigned int q = row[4 + 4 * word + c];
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[i] = d * low_nibble_to_float(q >> (8 * i + 4 * half)) - dm;
            }
            b[2 * word + 0] = pack_bf16x2(v[0], v[1]);
            b[2 * word + 1] = pack_bf16x2(v[2], v[3]);
        }
    }
};

// The 32-bit word at byte 4 k + shift / 8 of staged words (shift 0 or 16), in one funnel shift.
__device__ unsigned int direct_word_at(const unsigned int* words, int k, unsigned int shift) {
#if defined(DIRECT_NVIDIA)
    unsigned int out;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(words[k]), "r"(words[k + 1]), "r"(shift));
    return out;
#else
    return (unsigned int)((((unsigned long long)words[k + 1] << 32) | words[k]) >> shift);
#endif
}

// 2^23 + byte I of v as a float, without an integer-to-float conversion (a slow unit) or a shift:
// one byte permutation puts the byte under the exponent's bits.
template <int I>
__device__ float byte_plus_2_23(unsigned int v) {
#if defined(DIRECT_NVIDIA)
    unsigned int exponent;
    asm("mov.b32 %0, 0x4B000000;" : "=r"(exponent));
    unsigned int out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(v), "r"(exponent), "n"(0x7540 | I));  // v.I, 0, 0, 0x4B
    return bits_to_float(out);
#else
    return bits_to_float(((v >> (8 * I)) & 0xffu) | 0x4B000000u);
#endif
}

// Q6_K's Prep: d times the scale of each of the step's four chunks, and the shift that brings the
// step's staged words down to the block's bytes (16 where the block starts 2 bytes past a 4-byte
// boundary, else 0).
struct __attribute__((aligned(16))) DirectScales {
    float scale[4];
    unsigned int shift;
};

// Q6_K: ql[128] qh[64] scales[16] d in 210-byte blocks, element 128 n + 32 r + l (half n, slice r)
// the low (r < 2) or high nibble of ql byte 64 n + 32 (r % 2) + l and bits 2r, 2r + 1 of qh byte
// 32 n + l, times d * scales[8 n + 2 r + l / 16]. Step ks (group g = ks % 4 = 2 n + p of its block)
// takes slices p and p + 2 of half n rather than 64 consecutive elements: their quants share the 32
// ql bytes 64 n + 32 p .. (low nibbles, then high), so a step stages 32 ql bytes instead of 64.
// Chunks 0, 1 are slice p, chunks 2, 3 slice p + 2: the activations come from x_at(ks) = 256 b + 128 n
// + 32 p on, parts 4-7 from 64 elements further (moe_round_x_direct's order is per 16-element chunk,
// so a chunk's fragment order holds wherever it comes from). Results are summed in this order on
// every tile height alike.
// Staged: words 0-8 the ql bytes, 9-17 qh bytes 32 n .. (block byte 128 + 32 n), 18-22 the scales
// and d (byte 192 on), each run one word longer than its bytes, for the block's 2-byte offset; each
// run is copied as a group of 8 or 4 words and a group of 1, so that a warp's copies of a group hold
// whole rows. Lane c takes ql and qh words c (chunks 0 and 2) and 4 + c (chunks 1 and 3).
template <> struct Direct<ES_TYPE_Q6_K> {
    typedef DirectScales Prep;
    static const int STEP_WORDS = 23;
    static const bool ALIGNED = false;
    static const bool PREPARES = true;
    static const bool SPLIT = true;
    static const int GROUPS = 6;
    static constexpr int FIRST[GROUPS + 1] = {0, 8, 9, 17, 18, 22, STEP_WORDS};
    static const int QH_WORD = 9;
    static const int TAIL_WORD = 18;
    __device__ static int step(int ks, int group) {
        const int block = BlockFormat<ES_TYPE_Q6_K>::bytes * (ks / 4);
        const int g = ks % 4;
        if (group < 2) {
            return block + 32 * g;
        }
        return group < 4 ? block + 128 + 32 * (g / 2) - 4 * QH_WORD : block + 192 - 4 * TAIL_WORD;
    }
    __device__ static int x_at(int ks) {
        return DIRECT_K * ks - 32 * (ks % 2);
    }
    __device__ static int x_part(int part) {
        return 8 * part + 32 * (part / 4);
    }
    // 0 times a block's d: +0 when it is finite, and then so is every value of the block.
    __device__ static float zero_times_scales(const unsigned char* block) {
        return 0.0f * half_to_float(*(const unsigned short*)(block + 208));
    }
    // The 16 bits at byte x (even) of the staged scales and d.
    __device__ static unsigned int tail_half(const unsigned int* row, unsigned int x) {
        return (row[TAIL_WORD + x / 4] >> (8 * (x % 4))) & 0xffffu;
    }
    __device__ static float signed_byte(unsigned int b) {
        const int v = (int)(b & 0xffu);
        return (float)(v >= 128 ? v - 256 : v);
    }
    // decode_slice's d * scale of the step's four chunks: scales 8 n + 2 p, + 1 (slice p) and
    // 8 n + 2 p + 4, + 5 (slice p + 2).
    __device__ static void prepare(const unsigned int* row, int ks, unsigned int row_at, DirectScales* prep) {
        const int g = ks % 4;
        const unsigned int at = (row_at + (unsigned int)step(ks, 0)) & 3u;  // 0 or 2
        const float d = half_to_float(tail_half(row, 16 + at));
        const unsigned int first = 8 * (g / 2) + 2 * (g % 2) + at;
        const unsigned int low = tail_half(row, first);
        const unsigned int high = tail_half(row, first + 4);
        DirectScales out;
        out.scale[0] = d * signed_byte(low);
        out.scale[1] = d * signed_byte(low >> 8);
        out.scale[2] = d * signed_byte(high);
        out.scale[3] = d * signed_byte(high >> 8);
        out.shift = 8 * at;
        *prep = out;
    }
    // Part 0 (chunks 0, 1): the low nibbles and qh bits 2p, 2p + 1; part 1 (chunks 2, 3): the high
    // nibbles and bits 2p + 4, 2p + 5. The four 6-bit quants are put together in the four bytes of one
    // word, each byte then made a float by one permutation: dl (q - 32) = dl ((2^23 + q) - (2^23 + 32)),
    // the subtraction exact, as decode_slice's integer one is.
    __device__ static void decode(const unsigned int* row, int c, int ks, const DirectScales& prep, int part,
                                  unsigned int* b) {
        const int p = ks % 2;
#pragma unroll
        for (int word = 0; word < 2; ++word) {  // chunk 2 * part + word
            const unsigned int ql = direct_word_at(row, 4 * word + c, prep.shift);
            const unsigned int qh = direct_word_at(row, QH_WORD + 4 * word + c, prep.shift);
            const unsigned int q = part == 0 ? (ql & 0x0f0f0f0fu) | ((qh << (4 - 2 * p)) & 0x30303030u)
                                             : ((ql >> 4) & 0x0f0f0f0fu) | ((qh >> (2 * p)) & 0x30303030u);
            const float dl = prep.scale[2 * part + word];
            const float v0 = dl * (byte_plus_2_23<0>(q) - 8388640.0f);
            const float v1 = dl * (byte_plus_2_23<1>(q) - 8388640.0f);
            const float v2 = dl * (byte_plus_2_23<2>(q) - 8388640.0f);
            const float v3 = dl * (byte_plus_2_23<3>(q) - 8388640.0f);
            b[2 * word + 0] = pack_bf16x2(v0, v1);
            b[2 * word + 1] = pack_bf16x2(v2, v3);
        }
    }
};

// MXFP4 code + 12 (0..24: the value of each code, ggml's doubled E2M1 values, made non-negative) of the
// four codes in the low 16 bits of s, one byte each: codes 0-7 from one pair of table words, 8-15
// from the other, each byte then taken from the pair bit 3 of its code names, in three byte
// permutations.
__device__ unsigned int mxfp4_codes_plus_12(unsigned int s) {
#if defined(DIRECT_NVIDIA)
    const unsigned int index = s & 0x7777u;
    const unsigned int pick = 0x3210u | ((s & 0x8888u) >> 1);
    unsigned int low;
    unsigned int high;
    unsigned int out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(low) : "r"(0x0F0E0D0Cu), "r"(0x18141210u), "r"(index));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(high) : "r"(0x090A0B0Cu), "r"(0x00040608u), "r"(index));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(low), "r"(high), "r"(pick));
    return out;
#else
    unsigned int out = 0;
    for (int i = 0; i < 4; ++i) {
        out |= (unsigned int)(MXFP4_VALUES[(s >> (4 * i)) & 0xfu] + 12) << (8 * i);
    }
    return out;
#endif
}

// MXFP4: two 17-byte blocks per step (e, then qs[16] whose byte j holds code j, low nibble, and
// j + 16, high; a code's value is MXFP4_VALUES[code] times 2^(e - 128)). A step's 34 bytes start 0
// or 2 bytes past a 4-byte boundary (rows of whole steps, 34 bytes each): staged from the boundary
// below, nine words. Lane c takes qs bytes 4c .. 4c+3 of each block: elements 4c .. 4c+3 (chunk 2 blk,
// low nibbles) and 16 + 4c .. (chunk 2 blk + 1, high), as for Q4_0. The values are decode_slice's:
// d times the code's value, both exact, the code's value made a float without a conversion.
template <> struct Direct<ES_TYPE_MXFP4> : DirectContiguous {
    typedef DirectScales Prep;
    static const int STEP_WORDS = 9;
    static const bool ALIGNED = false;
    static const bool PREPARES = true;
    static const bool SPLIT = true;
    static const int GROUPS = 1;
    static constexpr int FIRST[GROUPS + 1] = {0, STEP_WORDS};
    __device__ static int step(int ks, int) {
        return 34 * ks;
    }
    // Every value of these blocks is finite (the largest scale is 2^126): 0 times the scale is +0.
    __device__ static float zero_times_scales(const unsigned char* block) {
        return 0.0f * e8m0_half(block[0]);
    }
    // Both blocks' scales, and the shift of the step's start (8 or 24 bits into the staged words
    // for block 0's quants, 8 at for the step's first byte).
    __device__ static void prepare(const unsigned int* row, int ks, unsigned int row_at, DirectScales* prep) {
        const unsigned int at = (row_at + (unsigned int)step(ks, 0)) & 3u;  // 0 or 2
        DirectScales out;
        out.scale[0] = e8m0_half((row[0] >> (8 * at)) & 0xffu);
        out.scale[1] = e8m0_half((row[4] >> (8 * at + 8)) & 0xffu);  // byte 17 + at
        out.scale[2] = 0.0f;
        out.scale[3] = 0.0f;
        out.shift = 8 * at;
        *prep = out;
    }
    __device__ static void decode(const unsigned int* row, int c, int, const DirectScales& prep, int blk,
                                  unsigned int* b) {
        // Block 0's quants from byte at + 1 (words c, c + 1), block 1's from byte at + 18: word 5 + c
        // itself where at is 2, else words 4 + c, 5 + c (the last staged word is 8).
        const unsigned int q = blk == 0       ? direct_word_at(row, c, prep.shift + 8)
                               : prep.shift   ? row[5 + c]
                                              : direct_word_at(row, 4 + c, 16);
        const float d = prep.scale[blk];
        // Bytes of v01: elements 4c low, 4c high, 4c + 1 low, 4c + 1 high; v23 the same for 4c + 2, + 3.
        const unsigned int v01 = mxfp4_codes_plus_12(q & 0xffffu);
        const unsigned int v23 = mxfp4_codes_plus_12(q >> 16);
        const float k = 8388620.0f;  // 2^23 + 12
        b[0] = pack_bf16x2(d * (byte_plus_2_23<0>(v01) - k), d * (byte_plus_2_23<2>(v01) - k));
        b[1] = pack_bf16x2(d * (byte_plus_2_23<0>(v23) - k), d * (byte_plus_2_23<2>(v23) - k));
        b[2] = pack_bf16x2(d * (byte_plus_2_23<1>(v01) - k), d * (byte_plus_2_23<3>(v01) - k));
        b[3] = pack_bf16x2(d * (byte_plus_2_23<1>(v23) - k), d * (byte_plus_2_23<3>(v23) - k));
    }
};

// What padding_tail gives for a row (0 times every value read past its n_in elements, summed: +0,
// or NaN where a value there is not finite), from the scales of the blocks there alone: a value
// of these types is finite exactly when its block's scales are. padding_tail decodes every value,
// which for the down projection (rows of 768 elements, read up to 1024) was a third again of a
// block's decoding, at its start where nothing overlaps it.
template <int TYPE>
__device__ float direct_padding_tail(const unsigned char* row, int n_in) {
    const int block_elements = MOE_TILE_K * BlockFormat<TYPE>::slices;
    const int padded = (n_in + MOE_ROW_PADDING - 1) / MOE_ROW_PADDING * MOE_ROW_PADDING;
    float sum = 0.0f;
    for (int e = n_in; e < padded; e += block_elements) {
        sum += Direct<TYPE>::zero_times_scales(row + (long long)(e / block_elements) * BlockFormat<TYPE>::bytes);
    }
    return sum;
}

// ---------------------------------------------------------------------------------
// The activation tile: TILE_M rows of DIRECT_K bf16 (128 bytes, eight 16-byte parts), part h of
// row r stored at part h ^ (r % 8), so that the eight rows one ldmatrix phase reads hit distinct
// banks without padding.
// ---------------------------------------------------------------------------------

__device__ int direct_x_at(int row, int part) {
    return row * DIRECT_K + ((part ^ (row % 8)) * 8);
}

// The matrix step: acc (16 x 8, C fragment) += A (activation rows first_row .. +15, elements
// 16 chunk .. +15 of the step) times the B fragment (b0, b1).

#if defined(DIRECT_NVIDIA)

__device__ void direct_load_a(unsigned int* a, const unsigned short* tile, int first_row, int chunk, int lane) {
    ldmatrix_x4(a, tile + direct_x_at(first_row + lane % 16, 2 * chunk + lane / 16));
}

__device__ void direct_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    mma_m16n8k16(c, a, b0, b1);
}

__device__ void direct_copy16(unsigned short* to, const unsigned short* from) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(to)), "l"(from) : "memory");
}

__device__ void direct_copy4(unsigned int* to, const unsigned char* from) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(to)), "l"(from) : "memory");
}

__device__ void direct_copies_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ void direct_copies_wait() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

__device__ void direct_syncwarp() {
    __syncwarp();
}

#else  // DIRECT_GENERIC

// a0..a3 of mma.sync's A fragment, read from the tile by each lane itself.
__device__ void direct_load_a(unsigned int* a, const unsigned short* tile, int first_row, int chunk, int lane) {
    const int top = first_row + lane / 4;
    const int c = lane % 4;
    a[0] = *(const unsigned int*)(tile + direct_x_at(top, 2 * chunk) + 2 * c);
    a[1] = *(const unsigned int*)(tile + direct_x_at(top + 8, 2 * chunk) + 2 * c);
    a[2] = *(const unsigned int*)(tile + direct_x_at(top, 2 * chunk + 1) + 2 * c);
    a[3] = *(const unsigned int*)(tile + direct_x_at(top + 8, 2 * chunk + 1) + 2 * c);
}

__shared__ unsigned int direct_exchange_a[DIRECT_WARPS][32][4];
__shared__ unsigned int direct_exchange_b[DIRECT_WARPS][32][2];

// k slot s of row (A) or column (B) r lies in lane 4r + (s % 8) / 2, register s / 8 (B) or
// 2 (s / 8) (+1 for A rows 8..15), half s % 2.
__device__ float direct_half(unsigned int word, int s) {
    return bf16_to_float((word >> (16 * (s % 2))) & 0xffffu);
}

__device__ void direct_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) {
        direct_exchange_a[warp][lane][i] = a[i];
    }
    direct_exchange_b[warp][lane][0] = b0;
    direct_exchange_b[warp][lane][1] = b1;
    __syncthreads();
    for (int e = 0; e < 4; ++e) {
        const int row = lane / 4 + 8 * (e / 2);
        const int col = 2 * (lane % 4) + e % 2;
        float sum = c[e];
        for (int s = 0; s < 16; ++s) {
            const unsigned int a_word = direct_exchange_a[warp][4 * (row % 8) + (s % 8) / 2][2 * (s / 8) + row / 8];
            const unsigned int b_word = direct_exchange_b[warp][4 * col + (s % 8) / 2][s / 8];
            sum = fmaf(direct_half(a_word, s), direct_half(b_word, s), sum);
        }
        c[e] = sum;
    }
    __syncthreads();
}

__device__ void direct_copy16(unsigned short* to, const unsigned short* from) {
    const unsigned int* f = (const unsigned int*)from;
    unsigned int* t = (unsigned int*)to;
    t[0] = f[0];
    t[1] = f[1];
    t[2] = f[2];
    t[3] = f[3];
}

__device__ void direct_copy4(unsigned int* to, const unsigned char* from) {
    *to = *(const unsigned int*)from;
}

__device__ void direct_copies_commit() {}

__device__ void direct_copies_wait() {}

// The whole block, as every thread of it calls this where a warp's lanes meet.
__device__ void direct_syncwarp() {
    __syncthreads();
}

#endif

// acc += the activation tile's chunk `chunk` times the fragments b[j][at], b[j][at + 1] of the
// warp's four row groups, for every 16-pair block of the tile.
template <int M_BLOCKS, int B_WORDS>
__device__ void direct_products(float (&acc)[M_BLOCKS][DIRECT_GROUPS][4], const unsigned short* tile, int chunk,
                                int lane, const unsigned int (&b)[DIRECT_GROUPS][B_WORDS], int at) {
    DIRECT_UNROLL
    for (int i = 0; i < M_BLOCKS; ++i) {
        unsigned int a[4];
        direct_load_a(a, tile, 16 * i, chunk, lane);
        DIRECT_UNROLL
        for (int j = 0; j < DIRECT_GROUPS; ++j) {
            direct_mma(acc[i][j], a, b[j][at], b[j][at + 1]);
        }
    }
}

struct __attribute__((aligned(8))) DirectPair {
    float v[2];
};

// Columns n and n + 1 (n even) of an output row: one 8-byte store where rows hold an even number of
// outputs and start 8-byte aligned (pair_stores; then n + 1 is inside whenever n is), else two.
__device__ void direct_store_pair(float* row, int n, int n_out, bool pair_stores, const float (&v)[2]) {
    if (pair_stores) {
        if (n < n_out) {
            *(DirectPair*)(row + n) = DirectPair{{v[0], v[1]}};
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        if (n + e < n_out) {
            row[n + e] = v[e];
        }
    }
}

// ---------------------------------------------------------------------------------
// The kernel: TILE_M pairs x 128 weight rows per block of 4 warps.
// ---------------------------------------------------------------------------------

// Weight row of tile row r (0..127) and whether it is read (rows past n_out are not):
// plain and routed tiles take rows n0 .. n0+127 of w; a gate/up tile takes, per warp of 32,
// 16 gate rows then the same 16 up rows, from output n0 / 2 + 16 * (r / 32).
template <bool GATE_UP>
__device__ const unsigned char* direct_row(const unsigned char* w_expert, const unsigned char* w2_expert, int r,
                                           int n0, int n_out, long long row_bytes, bool* inside) {
    int n;
    const unsigned char* base = w_expert;
    if (GATE_UP) {
        n = n0 / 2 + 16 * (r / 32) + r % 16;
        base = (r % 32) < 16 ? w_expert : w2_expert;
    } else {
        n = n0 + r;
    }
    *inside = n < n_out;
    return base + (long long)(*inside ? n : n_out - 1) * row_bytes;
}

// p rounded down to a 4-byte boundary.
__device__ const unsigned char* direct_word_base(const unsigned char* p) {
    return p - ((unsigned long long)p & 3u);
}

// A warp's copies of one group of its rows' staged words: words F .. F + G - 1 of each of its 32
// weight rows (rows of STEP words in the stage), one word per lane and copy, coalesced: copy r of
// a lane takes word F + (lane + 32 r) % G of row (lane + 32 r) / G. Either the group is the whole
// row (copy r: the warp's staged words 32 r .. 32 r + 31) or G divides 32 (copy r: whole rows
// 32 r / G ..); both ways copy r lands STRIDE words after copy r - 1, so a copy's place in the
// stage is a constant offset from its lane's. Where it reads from is fixed but for the step: an
// offset within its tensor's expert, and for the gate/up kernels which tensor (the warp's rows 16
// .. 31 are the up tensor's): known per copy where each copy holds whole rows of one half of the
// warp's (G >= 2), else held in bit 31. The
// offsets count from the experts' starts rounded down to a 4-byte boundary (direct_word_base), which
// copy() is given; for types not ALIGNED each copy's address is rounded down too.
template <int F, int G, int STEP, bool ALIGNED, bool GATE_UP>
struct DirectWordCopies {
    static const int WORDS = G;
    static_assert(G > 0 && (G == STEP || 32 % G == 0), "copies a constant stride apart in the stage");
    static const int STRIDE = G == STEP ? 32 : 32 / WORDS * STEP;
    static const bool ONE_TENSOR = 32 % G == 0 && G >= 2;  // per copy
    unsigned int from[WORDS];

    __device__ static int row(int lane, int r) {
        return (lane + 32 * r) / WORDS;
    }
    __device__ static bool second(int lane, int r) {
        return GATE_UP && row(lane, r) >= 16;
    }
    // The lane's first copy's word in a warp's stage.
    __device__ static int stage_at(int lane) {
        return lane / WORDS * STEP + F + lane % WORDS;
    }
    __device__ void set(int lane, int warp, const unsigned char* w_expert, const unsigned char* w2_expert, int n0,
                        int n_out, long long row_bytes) {
#pragma unroll
        for (int r = 0; r < G; ++r) {
            bool inside;
            const unsigned char* at =
                direct_row<GATE_UP>(w_expert, w2_expert, 32 * warp + row(lane, r), n0, n_out, row_bytes, &inside);
            const bool up = second(lane, r);
            const unsigned char* base = direct_word_base(up ? w2_expert : w_expert);
            from[r] = (unsigned int)(at - base) + 4u * (F + (lane + 32 * r) % WORDS);
            if (!ONE_TENSOR && up) {
                from[r] |= 0x80000000u;
            }
        }
    }
    // Copies this step's words (step_bytes into each row) to the warp's stage; w_words, w2_words: the
    // experts' starts rounded down to a 4-byte boundary.
    __device__ void copy(unsigned int* stage, int lane, const unsigned char* w_words, const unsigned char* w2_words,
                         int step_bytes) const {
        unsigned int* to = stage + stage_at(lane);
#pragma unroll
        for (int r = 0; r < G; ++r) {
            const bool up = ONE_TENSOR ? second(0, r) : (from[r] & 0x80000000u) != 0;
            const unsigned int offset = (ONE_TENSOR ? from[r] : from[r] & 0x7fffffffu) + step_bytes;
            direct_copy4(to + STRIDE * r, (up ? w2_words : w_words) + (ALIGNED ? offset : offset & ~3u));
        }
    }
};

// The copies of every group of a type's staged words: group I's, then those of the groups after it.
template <int TYPE, int I, bool GATE_UP, bool END = I == Direct<TYPE>::GROUPS>
struct DirectStageCopies {
    typedef Direct<TYPE> D;
    DirectWordCopies<D::FIRST[I], D::FIRST[I + 1] - D::FIRST[I], D::STEP_WORDS, D::ALIGNED, GATE_UP> group;
    DirectStageCopies<TYPE, I + 1, GATE_UP> rest;

    __device__ void set(int lane, int warp, const unsigned char* w_expert, const unsigned char* w2_expert, int n0,
                        int n_out, long long row_bytes) {
        group.set(lane, warp, w_expert, w2_expert, n0, n_out, row_bytes);
        rest.set(lane, warp, w_expert, w2_expert, n0, n_out, row_bytes);
    }
    __device__ void copy(unsigned int* stage, int lane, const unsigned char* w_words, const unsigned char* w2_words,
                         int ks) const {
        group.copy(stage, lane, w_words, w2_words, D::step(ks, I));
        rest.copy(stage, lane, w_words, w2_words, ks);
    }
};

template <int TYPE, int I, bool GATE_UP>
struct DirectStageCopies<TYPE, I, GATE_UP, true> {
    __device__ void set(int, int, const unsigned char*, const unsigned char*, int, int, long long) {}
    __device__ void copy(unsigned int*, int, const unsigned char*, const unsigned char*, int) const {}
};

template <int TYPE, int TILE_M, bool GATE_UP>
__device__ void mul_mat_id_direct_tile(const unsigned char* __restrict__ w, const unsigned char* __restrict__ w2,
                                       const unsigned short* __restrict__ xb, const int* __restrict__ scratch,
                                       const float* __restrict__ route_weights, float* __restrict__ y,
                                       int n_expert, int n_out, int n_in, int top_k, int x_per_pair,
                                       int max_tiles) {
#if defined(DIRECT_TRAPS)
    __trap();
#else
    typedef Direct<TYPE> D;
    const int M_BLOCKS = TILE_M / 16;
    const int X_COPIES = TILE_M * (DIRECT_K / 8) / MOE_DIRECT_THREADS;  // 16-byte copies per thread and step
    const int W_WORDS = 32 * D::STEP_WORDS;                               // staged words per warp and step

    __shared__ __attribute__((aligned(16))) unsigned short x_tile[2][TILE_M * DIRECT_K];
    __shared__ unsigned int w_stage[2][DIRECT_WARPS][W_WORDS];
    __shared__ typename D::Prep w_prep[DIRECT_WARPS][32];  // this step's, per weight row of the warp
    __shared__ int src_row[TILE_M];
    __shared__ int dst_row[TILE_M];
    __shared__ float tail[MOE_TILE_N];
    __shared__ float route[TILE_M];  // each pair's routing weight, read by the epilogue

    // A gate/up block covers MOE_TILE_N / 2 outputs: its n0 counts tile rows, twice the outputs.
    const int expert = begin_tile<TILE_M, MOE_DIRECT_THREADS>(scratch, y, src_row, dst_row, n_expert, n_out, top_k,
                                                               x_per_pair, max_tiles);
    if (expert < 0) {
        return;
    }
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int n0 = blockIdx.x * MOE_TILE_N;
    const long long row_bytes = weight_row_bytes<TYPE>(n_in);
    const unsigned char* w_expert = w + (long long)expert * n_out * row_bytes;
    const unsigned char* w2_expert = GATE_UP ? w2 + (long long)expert * n_out * row_bytes : w_expert;
    const int k_steps = n_in / DIRECT_K;

    {
        bool inside;
        const unsigned char* row = direct_row<GATE_UP>(w_expert, w2_expert, tid, n0, n_out, row_bytes, &inside);
        tail[tid] = inside ? direct_padding_tail<TYPE>(row, n_in) : 0.0f;  // read after the k loop's barriers
    }
    // Where the weight row this lane prepares (row `lane` of the warp's) starts past a 4-byte boundary.
    unsigned int row_at;
    {
        bool inside;
        const unsigned char* row =
            direct_row<GATE_UP>(w_expert, w2_expert, 32 * warp + lane, n0, n_out, row_bytes, &inside);
        row_at = (unsigned int)((unsigned long long)row & 3u);
    }
    // The routing weights, read after the k loop's barriers. Loaded here, while the block's first
    // copies are in flight: read in the epilogue straight from global memory, each output row of a
    // lane waited for its own load, and the down projection's epilogue was a run of such waits.
    if (route_weights) {
        for (int m = tid; m < TILE_M; m += MOE_DIRECT_THREADS) {
            route[m] = dst_row[m] >= 0 ? route_weights[dst_row[m]] : 0.0f;
        }
    }

    // Each warp stages the words of its own 32 weight rows, group by group.
    const unsigned char* w_words = direct_word_base(w_expert);
    const unsigned char* w2_words = direct_word_base(w2_expert);
    DirectStageCopies<TYPE, 0, GATE_UP> stage;
    stage.set(lane, warp, w_expert, w2_expert, n0, n_out, row_bytes);
    // This thread's activation copies: part x_part of tile rows x_row + X_ROWS r, from xb's element
    // x_from[r] on (empty slots read the tile's first pair). Held across the k loop, where
    // registers are scarce: 32-bit offsets rather than pointers, and the rows' places in the
    // tile, X_ROWS apart (a multiple of 8, so the same swizzle), from one.
    const int X_ROWS = MOE_DIRECT_THREADS / (DIRECT_K / 8);
    const int x_part = tid % (DIRECT_K / 8);
    const int x_row = tid / (DIRECT_K / 8);
    const int x_to = direct_x_at(x_row, x_part);
    unsigned int x_from[X_COPIES];
#pragma unroll
    for (int r = 0; r < X_COPIES; ++r) {
        const int m = x_row + X_ROWS * r;
        const int src = src_row[m] >= 0 ? src_row[m] : src_row[0];
        x_from[r] = (unsigned int)src * (unsigned int)n_in + (unsigned int)D::x_part(x_part);
    }
    auto copy_step = [&](int ks, int buf) {
#pragma unroll
        for (int r = 0; r < X_COPIES; ++r) {
            direct_copy16(x_tile[buf] + x_to + X_ROWS * DIRECT_K * r, xb + x_from[r] + D::x_at(ks));
        }
        stage.copy(w_stage[buf][warp], lane, w_words, w2_words, ks);
        direct_copies_commit();
    };

    float acc[M_BLOCKS][DIRECT_GROUPS][4];
#pragma unroll
    for (int i = 0; i < M_BLOCKS; ++i) {
#pragma unroll
        for (int j = 0; j < DIRECT_GROUPS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[i][j][e] = 0.0f;
            }
        }
    }

    copy_step(0, 0);
    for (int ks = 0; ks < k_steps; ++ks) {
        const int buf = ks & 1;
        direct_copies_wait();
        // This step's activations and weights are in for every thread, and every warp is done with
        // the other buffers (read in the previous step), which the next copies overwrite.
        __syncthreads();
        if (ks + 1 < k_steps) {
            copy_step(ks + 1, buf ^ 1);
        }
        if (D::PREPARES) {
            // Read by the warp's lanes in this step only: the next step's writes come after the
            // block's next barrier.
            D::prepare(&w_stage[buf][warp][lane * D::STEP_WORDS], ks, row_at, &w_prep[warp][lane]);
            direct_syncwarp();
        }
        if (D::SPLIT) {
            // Half a step at a time: fewer fragment registers, and the second half's decoding can
            // overlap the first half's products.
            DIRECT_UNROLL
            for (int part = 0; part < 2; ++part) {
                unsigned int b[DIRECT_GROUPS][4];
#pragma unroll
                for (int j = 0; j < DIRECT_GROUPS; ++j) {
                    const int r = 8 * j + lane / 4;
                    D::decode(&w_stage[buf][warp][r * D::STEP_WORDS], lane % 4, ks, w_prep[warp][r], part, b[j]);
                }
                DIRECT_UNROLL
                for (int half = 0; half < 2; ++half) {
                    direct_products<M_BLOCKS>(acc, x_tile[buf], 2 * part + half, lane, b, 2 * half);
                }
            }
        } else {
            unsigned int b[DIRECT_GROUPS][8];
#pragma unroll
            for (int j = 0; j < DIRECT_GROUPS; ++j) {
                const int r = 8 * j + lane / 4;
#pragma unroll
                for (int part = 0; part < 2; ++part) {
                    D::decode(&w_stage[buf][warp][r * D::STEP_WORDS], lane % 4, ks, w_prep[warp][r], part,
                              b[j] + 4 * part);
                }
            }
            DIRECT_UNROLL
            for (int chunk = 0; chunk < DIRECT_K / 16; ++chunk) {
                direct_products<M_BLOCKS>(acc, x_tile[buf], chunk, lane, b, 2 * chunk);
            }
        }
    }

    // C element e of lane l: row l / 4 + 8 (e / 2), column 2 (l % 4) + e % 2 of its n8 group. Elements
    // 2h and 2h + 1 are two neighbouring columns of one output row, stored together.
    const bool pair_stores = n_out % 2 == 0 && (unsigned long long)y % sizeof(DirectPair) == 0;
#pragma unroll
    for (int i = 0; i < M_BLOCKS; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = 16 * i + lane / 4 + 8 * h;
            const int p = dst_row[m];
            if (p < 0) {
                continue;
            }
            float* out = y + (long long)p * n_out;
            const int col = 2 * (lane % 4);
            if (GATE_UP) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int r = 32 * warp + 8 * j + col;  // the gate row; its up row is r + 16
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float g = acc[i][j][2 * h + e] + tail[r + e];
                        const float u = acc[i][j + 2][2 * h + e] + tail[r + e + 16];
                        v[e] = silu_times(g, u);
                    }
                    direct_store_pair(out, n0 / 2 + 16 * warp + 8 * j + col, n_out, pair_stores, v);
                }
            } else {
#pragma unroll
                for (int j = 0; j < DIRECT_GROUPS; ++j) {
                    const int r = 32 * warp + 8 * j + col;
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        v[e] = acc[i][j][2 * h + e] + tail[r + e];
                        if (route_weights) {
                            v[e] = route[m] * v[e];
                        }
                    }
                    direct_store_pair(out, n0 + r, n_out, pair_stores, v);
                }
            }
        }
    }
#endif
}

// The plain kernels take (w, xb, scratch, y, ..., route_weights), route_weights null or one float per
// pair; the gate/up kernels (w_gate, w_up, xb, scratch, y, ...), y the activated [pairs, n_out] outputs.
#define MOE_MUL_MAT_ID_DIRECT(NAME, TYPE, TILE_M)                                                          \
    extern "C" __global__ void __launch_bounds__(DIRECT_BOUNDS(TYPE, TILE_M))                           \
        NAME(const unsigned char* __restrict__ w, const unsigned short* __restrict__ xb,                \
             const int* __restrict__ scratch, float* __restrict__ y, int n_expert, int n_out, int n_in,  \
             int top_k, int x_per_pair, int max_tiles, const float* __restrict__ route_weights) {        \
        KERNEL_PROLOGUE();                                                                               \
        mul_mat_id_direct_tile<TYPE, TILE_M, false>(w, w, xb, scratch, route_weights, y, n_expert, n_out, \
                                                    n_in, top_k, x_per_pair, max_tiles);                 \
    }

#define MOE_GATE_UP_DIRECT(NAME, TYPE, TILE_M)                                                             \
    extern "C" __global__ void __launch_bounds__(DIRECT_BOUNDS(TYPE, TILE_M))                           \
        NAME(const unsigned char* __restrict__ w_gate, const unsigned char* __restrict__ w_up,          \
             const unsigned short* __restrict__ xb, const int* __restrict__ scratch,                    \
             float* __restrict__ y, int n_expert, int n_out, int n_in, int top_k, int x_per_pair,        \
             int max_tiles) {                                                                            \
        KERNEL_PROLOGUE();                                                                               \
        mul_mat_id_direct_tile<TYPE, TILE_M, true>(w_gate, w_up, xb, scratch, 0, y, n_expert, n_out, n_in, \
                                                   top_k, x_per_pair, max_tiles);                        \
    }

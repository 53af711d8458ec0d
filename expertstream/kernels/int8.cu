// mul_mat_id on int8 matrix instructions, for the types whose quants are small integers under
// one scale per 32 elements (Q4_0; Q4_K with its 6-bit scale and min per 32-element sub-block).
// Compiled after the shared files and mma.cu as one source with them (block formats, padding_tail,
// begin_tile, weight_row_bytes and the C-fragment lane functions are used here); the kernel
// instances at its end are generated from layout.FORMATS by kernel_source().
//
// Activations first go through moe_quantize_x, once per call: per 32-element block
// d = amax / 127 and q = rint(x / d) (round to nearest even, clamped to [-127, 127]), all in
// float32, and s = d * sum(q); a block holding a NaN or an infinity gets d = s = NaN and
// q = 0, so its outputs are NaN; an all-zero block gets d = 0 and q = 0. The quantized rows
// lie in the scratch, each int8_x_row_bytes(n_in) long (16-byte aligned): n_in int8 q, then
// one (d, s) float pair per 32-element block.
//
// The matrix kernel then never converts a weight to floating point: per 32-element block
// the int32 dot product of the weight quants (Q4_0: nibble - 8; Q4_K: the nibble) with the
// activation quants is taken on the matrix unit, and the float32 accumulator of each output
// takes it as acc = fmaf(dw * dx, dot, acc) (Q4_K: dw = d * sc, then acc = fmaf(-dmin * m,
// s, acc)), block after block in ascending k. So y is the product of the decoded weights
// with the activations rounded to the int8 grid, in float32, and each output depends on its
// own weight row and activation row only: byte-identical across groupings and tile heights.
//
// Per k step of INT8_TILE_K = 64 elements a block of MOE_INT8_THREADS threads stages, in
// registers while the previous step's products run, the raw weight units of its MOE_TILE_N
// rows (coalesced) and the quantized activations of its TILE_M rows (16-byte loads). Then:
// raw units to shared memory, barrier, activations to their shared tile and each weight row
// repacked to 8 nibble words plus float scales per 32-block (two threads per row), barrier,
// products. Two barriers per 64 elements; every shared tile is written only between the two
// barriers and read only after the second, so one buffer of each suffices.
//
// The matrix step (Int8A, Int8B, int8_load_a/b, int8_step: a 16 x 32 block of activation
// quants times a 32 x 8 block of weight quants into 16 x 8 int32, C element e of lane l at
// row mma_sync_row(l, e), column mma_sync_col(l, e)) is chosen by target:
// - NVIDIA sm_80 and newer: ldmatrix and mma.sync m16n8k32 s8 (32-lane warps);
// - anything else (AMD included): plain integer multiply-adds over the same shared tiles in
//   logical waves of 32 threads, so the source compiles and runs everywhere. The launcher
//   takes this path only where Capabilities.int8_matrix_cores is set (NVIDIA sm_80+); AMD
//   devices stay on the bf16 path until MFMA/WMMA i8 steps are written and compile-checked.
//
// Products are accumulated into int32 registers preset to the bits of 1.5 * 2^23: a block's
// dot is at most 32 * 127 * 15 in magnitude (< 2^22), so those bits read as float are
// exactly 1.5 * 2^23 + dot, and one float subtraction gives the dot exactly (no conversion).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define INT8_NVIDIA 1
#else
#define INT8_GENERIC 1
#endif

// Must match expertstream/kernels/layout.py.
#define MOE_INT8_THREADS 256
#define MOE_QUANT_THREADS 256
#define MOE_QUANT_BLOCK 32
#define INT8_TILE_K 64           // elements per k step: two 32-element blocks
#define INT8_X_STRIDE 80         // bytes per shared activation row: 64 + 16, conflict-free for ldmatrix
#define INT8_W_WORDS 12          // words per shared weight row: 8 + 4, conflict-free fragment reads
#define INT8_DOT_BIAS 0x4B400000 // 1.5 * 2^23 as float bits
#define INT8_DOT_BIAS_FLOAT 12582912.0f

struct alignas(16) Int8Chunk {
    unsigned int x, y, z, w;
};

__device__ int int8_x_row_bytes(int n_in) {
    return (n_in + n_in / MOE_QUANT_BLOCK * 8 + 15) / 16 * 16;
}

// ---------------------------------------------------------------------------------
// Activation quantization: one thread per 32-element block.
// ---------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(MOE_QUANT_THREADS)
    moe_quantize_x(const float* __restrict__ x, unsigned char* __restrict__ xq, int n_rows, int n_in) {
    KERNEL_PROLOGUE();
    const int blocks_per_row = n_in / MOE_QUANT_BLOCK;
    const long long b = (long long)blockIdx.x * MOE_QUANT_THREADS + threadIdx.x;
    if (b >= (long long)n_rows * blocks_per_row) {
        return;
    }
    const float* src = x + b * MOE_QUANT_BLOCK;
    float v[MOE_QUANT_BLOCK];
    for (int j = 0; j < MOE_QUANT_BLOCK; ++j) {
        v[j] = src[j];
    }
    unsigned int words[MOE_QUANT_BLOCK / 4];
    const Int8Scales out = quantize_block32(v, words);
    const long long row = b / blocks_per_row;
    const int block = (int)(b - row * blocks_per_row);
    unsigned char* dst = xq + row * int8_x_row_bytes(n_in);
    for (int j = 0; j < MOE_QUANT_BLOCK / 4; ++j) {
        ((unsigned int*)(dst + block * MOE_QUANT_BLOCK))[j] = words[j];
    }
    ((Int8Scales*)(dst + n_in))[block] = out;
}

// ---------------------------------------------------------------------------------
// How each type's weights reach the int8 step. Per k step a row stages UNITS 16-bit units,
// unit h at byte unit_at(ks, h) of the row. prepare() turns the staged units of 32-element
// block `half` (0 or 1) of step ks into 4 nibble words at words[4 * half ..] and its scales;
// b_words() gives the B fragment of lane quad position c for block kb: the quants of k
// 4c..4c+3 in b0 and of k 16+4c..16+4c+3 in b1, one signed byte each.
// ---------------------------------------------------------------------------------

template <int TYPE> struct Int8Format;

// Byte j (0..15) of a block's qs holds element j in its low nibble and element j + 16 in its
// high nibble, so word c holds k 4c..4c+3 (low) and 16+4c.. (high): b0 and b1 as they are.
template <> struct Int8Format<ES_TYPE_Q4_0> {
    static const int UNITS = 18;  // two blocks of d and 16 qs bytes
    static const bool has_min = false;
    __device__ static int unit_at(int ks, int h) { return ks * 36 + 2 * h; }
    __device__ static void prepare(const unsigned short* units, int half, unsigned int* words, Int8Scales* scales,
                                   int) {
        const unsigned short* block = units + 9 * half;
        for (int i = 0; i < 4; ++i) {
            words[4 * half + i] = (unsigned int)block[1 + 2 * i] | ((unsigned int)block[2 + 2 * i] << 16);
        }
        Int8Scales s;
        s.d = half_to_float(block[0]);
        s.s = 0.0f;
        scales[half] = s;
    }
    __device__ static void b_words(const unsigned int* words, int kb, int c, unsigned int* b0, unsigned int* b1) {
        const unsigned int w = words[4 * kb + c];
        *b0 = nibbles_minus_8(w & 0x0f0f0f0fu);
        *b1 = nibbles_minus_8((w >> 4) & 0x0f0f0f0fu);
    }
};

// A step is one 64-element chunk j = ks % 4 of a 256-element block: the 16-byte header (d,
// dmin, 12 packed scale bytes) and the chunk's 32 qs bytes, whose low nibbles are sub-block 2j
// (element i in byte i) and high nibbles sub-block 2j + 1. For block kb of the step, k 4c..
// are in word c and k 16+4c.. in word 4 + c, in the nibble kb selects.
template <> struct Int8Format<ES_TYPE_Q4_K> {
    static const int UNITS = 24;  // 8 header units, 16 qs units
    static const bool has_min = true;
    __device__ static int unit_at(int ks, int h) {
        return (ks >> 2) * 144 + (h < 8 ? 2 * h : 16 + 32 * (ks & 3) + 2 * (h - 8));
    }
    __device__ static void prepare(const unsigned short* units, int half, unsigned int* words, Int8Scales* scales,
                                   int ks) {
        for (int i = 0; i < 4; ++i) {
            const int u = 8 + 2 * (4 * half + i);
            words[4 * half + i] = (unsigned int)units[u] | ((unsigned int)units[u + 1] << 16);
        }
        int sc;
        int m;
        k4_scale_min(units, 2 * (ks & 3) + half, &sc, &m);
        Int8Scales s;
        s.d = half_to_float(units[0]) * (float)sc;
        s.s = half_to_float(units[1]) * (float)m;
        scales[half] = s;
    }
    __device__ static void b_words(const unsigned int* words, int kb, int c, unsigned int* b0, unsigned int* b1) {
        *b0 = (words[c] >> (4 * kb)) & 0x0f0f0f0fu;
        *b1 = (words[4 + c] >> (4 * kb)) & 0x0f0f0f0fu;
    }
};

// ---------------------------------------------------------------------------------
// The int8 step. a points at A[0][0] of a 16 x 32 block of the activation tile (rows of
// INT8_X_STRIDE bytes), w at the nibble words of the 8 weight rows of the block (rows of
// INT8_W_WORDS words), kb the 32-element block of the step.
// ---------------------------------------------------------------------------------

// The byte offset each lane hands ldmatrix .x4 for A (16 int8 = 8 b16 per 8 x 8 matrix row):
// lanes 8j..8j+7 name the rows of matrix j, which mma.sync m16n8k32 takes as a_j: rows 0-7 and
// 8-15 of k 0-15, then of k 16-31. Lane l gets row l / 4 (+ 8), bytes 4 (l % 4).. of each.
__device__ int int8_ldmatrix_a_offset(int lane) {
    return (lane % 16) * INT8_X_STRIDE + (lane / 16) * 16;
}

// The weight row (B column) whose words lane l reads for its B fragment, and the quad position.
__device__ int int8_b_row(int lane) {
    return lane / 4;
}

__device__ int int8_b_quad(int lane) {
    return lane % 4;
}

#if defined(INT8_NVIDIA)

struct Int8A {
    unsigned int r[4];
};
struct Int8B {
    unsigned int b0;
    unsigned int b1;
};

__device__ void int8_load_a(Int8A& a, const unsigned char* p, int lane) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3])
                 : "r"(shared_address(p + int8_ldmatrix_a_offset(lane)))
                 : "memory");
}

template <int TYPE>
__device__ void int8_load_b(Int8B& b, const unsigned int* w, int kb, int lane) {
    Int8Format<TYPE>::b_words(w + int8_b_row(lane) * INT8_W_WORDS, kb, int8_b_quad(lane), &b.b0, &b.b1);
}

template <int TYPE>
__device__ void int8_step(int* c, const Int8A& a, const Int8B& b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.b0), "r"(b.b1));
}

#else  // INT8_GENERIC

// The fragments are the shared tiles themselves. Lane l computes its four C elements, each
// as the integer dot of an activation row with a weight row whose quants come from the same
// b_words the matrix path uses (as the four lanes of that column hold them there).
struct Int8A {
    const unsigned char* p;
};
struct Int8B {
    const unsigned int* w;
    int kb;
};

__device__ void int8_load_a(Int8A& a, const unsigned char* p, int) {
    a.p = p;
}

template <int TYPE>
__device__ void int8_load_b(Int8B& b, const unsigned int* w, int kb, int) {
    b.w = w;
    b.kb = kb;
}

__device__ int int8_signed_byte(unsigned int word, int i) {
    return (int)(signed char)(unsigned char)(word >> (8 * i));
}

template <int TYPE>
__device__ void int8_step(int* c, const Int8A& a, const Int8B& b) {
    const int lane = threadIdx.x % 32;
    for (int e = 0; e < 4; ++e) {
        const signed char* a_row = (const signed char*)(a.p + mma_sync_row(lane, e) * INT8_X_STRIDE);
        const unsigned int* w_row = b.w + mma_sync_col(lane, e) * INT8_W_WORDS;
        int dot = 0;
        for (int quad = 0; quad < 4; ++quad) {
            unsigned int b0;
            unsigned int b1;
            Int8Format<TYPE>::b_words(w_row, b.kb, quad, &b0, &b1);
            for (int i = 0; i < 4; ++i) {
                dot += (int)a_row[4 * quad + i] * int8_signed_byte(b0, i);
                dot += (int)a_row[16 + 4 * quad + i] * int8_signed_byte(b1, i);
            }
        }
        c[e] += dot;
    }
}

#endif


// ---------------------------------------------------------------------------------
// The kernel: TILE_M pairs x MOE_TILE_N outputs per block of MOE_INT8_THREADS threads, in
// waves of 32 laid out WAVES_M x WAVES_N; each owns 32 rows (two 16-row blocks) and N8 blocks
// of 8 columns.
// ---------------------------------------------------------------------------------

template <int TYPE, int TILE_M>
__device__ void mul_mat_id_int8_tile(const unsigned char* __restrict__ w, const unsigned char* __restrict__ xq,
                                     const int* __restrict__ scratch, float* __restrict__ y, int n_expert,
                                     int n_out, int n_in, int top_k, int x_per_pair, int max_tiles) {
    typedef Int8Format<TYPE> F;
    const int THREADS = MOE_INT8_THREADS;
    const int UNITS = F::UNITS;
    const int RAW_STRIDE = (UNITS / 2 | 1) * 2;  // units per staged row: an odd number of words
    const int RAW_PER_THREAD = UNITS * MOE_TILE_N / THREADS;
    const int WAVES_M = TILE_M / 32;
    const int WAVES_N = THREADS / 32 / WAVES_M;
    const int N8 = MOE_TILE_N / 8 / WAVES_N;
    const int PIECES = INT8_TILE_K / 16;  // 16-byte pieces of one row's activation quants per step
    const int X_PER_THREAD = (TILE_M * PIECES + THREADS - 1) / THREADS;
    const int S_PER_THREAD = (TILE_M * 2 + THREADS - 1) / THREADS;
    static_assert(UNITS * MOE_TILE_N % THREADS == 0, "staged units spread evenly over the threads");
    static_assert(2 * MOE_TILE_N == THREADS, "two threads prepare each weight row");

    __shared__ __attribute__((aligned(16))) unsigned char x_tile[TILE_M * INT8_X_STRIDE];
    __shared__ Int8Scales x_scales[TILE_M * 2];
    __shared__ unsigned int w_tile[MOE_TILE_N * INT8_W_WORDS];
    __shared__ Int8Scales w_scales[MOE_TILE_N * 2];
    __shared__ unsigned short raw[MOE_TILE_N * RAW_STRIDE];
    __shared__ int src_row[TILE_M];
    __shared__ int dst_row[TILE_M];
    __shared__ float tail[MOE_TILE_N];

    const int expert =
        begin_tile<TILE_M, THREADS>(scratch, y, src_row, dst_row, n_expert, n_out, top_k, x_per_pair, max_tiles);
    if (expert < 0) {
        return;
    }
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * MOE_TILE_N;
    const int row_bytes = (int)weight_row_bytes<TYPE>(n_in);
    const unsigned char* w_expert = w + (long long)expert * n_out * row_bytes;
    const int blocks_per_row = n_in / MOE_QUANT_BLOCK;
    const int k_steps = (blocks_per_row + 1) / 2;
    const int x_row_bytes = int8_x_row_bytes(n_in);

    if (tid < MOE_TILE_N) {
        tail[tid] = n0 + tid < n_out ? padding_tail<TYPE>(w_expert + (long long)(n0 + tid) * row_bytes, n_in) : 0.0f;
    }

    // Where each thread's staged pieces come from, fixed over k: activation piece i is piece
    // i % PIECES of tile row i / PIECES, scale pair i is block i % 2 of tile row i / 2. Weight
    // rows past n_out and the activation rows of a tile's empty slots read row n_out - 1 and
    // the tile's first pair instead: their products land only in outputs never stored.
    const unsigned char* x_from[X_PER_THREAD];
#pragma unroll
    for (int r = 0; r < X_PER_THREAD; ++r) {
        const int i = tid + r * THREADS < TILE_M * PIECES ? tid + r * THREADS : 0;
        const int src = src_row[i / PIECES] >= 0 ? src_row[i / PIECES] : src_row[0];
        x_from[r] = xq + (long long)src * x_row_bytes + 16 * (i % PIECES);
    }
    const Int8Scales* s_from[S_PER_THREAD];
#pragma unroll
    for (int r = 0; r < S_PER_THREAD; ++r) {
        const int i = tid + r * THREADS < TILE_M * 2 ? tid + r * THREADS : 0;
        const int src = src_row[i / 2] >= 0 ? src_row[i / 2] : src_row[0];
        s_from[r] = (const Int8Scales*)(xq + (long long)src * x_row_bytes + n_in) + i % 2;
    }

    // Staged units are packed two to a 32-bit register: they are held across the products.
    unsigned int raw_regs[(RAW_PER_THREAD + 1) / 2];
    Int8Chunk x_regs[X_PER_THREAD];
    Int8Scales s_regs[S_PER_THREAD];
    auto load_step = [&](int ks) {
        // A Q4_0 row of an odd number of blocks ends in a step of one block.
        const bool both_blocks = 2 * ks + 1 < blocks_per_row;
#pragma unroll
        for (int r = 0; r < RAW_PER_THREAD; ++r) {
            const int i = tid + r * THREADS;
            const int n = i / UNITS;
            const int h = i - n * UNITS;
            const int row = n0 + n < n_out ? n0 + n : n_out - 1;
            const unsigned int unit =
                both_blocks || h < UNITS / 2 ? *(const unsigned short*)(w_expert + row * row_bytes + F::unit_at(ks, h))
                                             : 0u;
            if (r % 2 == 0) {
                raw_regs[r / 2] = unit;
            } else {
                raw_regs[r / 2] |= unit << 16;
            }
        }
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int piece = (tid + r * THREADS) % PIECES;
            Int8Chunk chunk = {0u, 0u, 0u, 0u};
            if (tid + r * THREADS < TILE_M * PIECES && INT8_TILE_K * ks + 16 * piece < n_in) {
                chunk = *(const Int8Chunk*)(x_from[r] + INT8_TILE_K * ks);
            }
            x_regs[r] = chunk;
        }
#pragma unroll
        for (int r = 0; r < S_PER_THREAD; ++r) {
            Int8Scales scales = {0.0f, 0.0f};
            if (tid + r * THREADS < TILE_M * 2 && 2 * ks + (tid + r * THREADS) % 2 < blocks_per_row) {
                scales = s_from[r][2 * ks];
            }
            s_regs[r] = scales;
        }
    };

    const int lane = tid % 32;
    const int wave = tid / 32;
    const int row0 = (wave % WAVES_M) * 32;
    const int col0 = (wave / WAVES_M) * N8 * 8;
    float acc[2][N8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < N8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[i][j][e] = 0.0f;
            }
        }
    }

    load_step(0);
    for (int ks = 0; ks < k_steps; ++ks) {
        // raw is read by the repacking before the second barrier of the previous step.
#pragma unroll
        for (int r = 0; r < RAW_PER_THREAD; ++r) {
            const int i = tid + r * THREADS;
            const int n = i / UNITS;
            raw[n * RAW_STRIDE + i - n * UNITS] = (unsigned short)(raw_regs[r / 2] >> (16 * (r % 2)));
        }
        __syncthreads();
        // The tiles below are read by the products after the second barrier, and the previous
        // step's products are done: every thread has passed the barrier above.
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int i = tid + r * THREADS;
            if (i < TILE_M * PIECES) {
                *(Int8Chunk*)(x_tile + (i / PIECES) * INT8_X_STRIDE + 16 * (i % PIECES)) = x_regs[r];
            }
        }
#pragma unroll
        for (int r = 0; r < S_PER_THREAD; ++r) {
            if (tid + r * THREADS < TILE_M * 2) {
                x_scales[tid + r * THREADS] = s_regs[r];
            }
        }
        {
            const int n = tid % MOE_TILE_N;
            F::prepare(raw + n * RAW_STRIDE, tid / MOE_TILE_N, w_tile + n * INT8_W_WORDS, w_scales + 2 * n, ks);
        }
        __syncthreads();
        if (ks + 1 < k_steps) {
            load_step(ks + 1);  // in flight during the products
        }
        const int blocks = 2 * ks + 1 < blocks_per_row ? 2 : 1;
        for (int kb = 0; kb < blocks; ++kb) {
            Int8A a[2];
            Int8Scales xs[2][2];  // [16-row block][row lane / 4, then lane / 4 + 8]
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                int8_load_a(a[i], x_tile + (row0 + 16 * i) * INT8_X_STRIDE + 32 * kb, lane);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    xs[i][h] = x_scales[2 * (row0 + 16 * i + lane / 4 + 8 * h) + kb];
                }
            }
#pragma unroll
            for (int j = 0; j < N8; ++j) {
                Int8B b;
                int8_load_b<TYPE>(b, w_tile + (col0 + 8 * j) * INT8_W_WORDS, kb, lane);
                Int8Scales ws[2];  // columns 2 (lane % 4) and 2 (lane % 4) + 1
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    ws[h] = w_scales[2 * (col0 + 8 * j + 2 * (lane % 4) + h) + kb];
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    int dots[4] = {INT8_DOT_BIAS, INT8_DOT_BIAS, INT8_DOT_BIAS, INT8_DOT_BIAS};
                    int8_step<TYPE>(dots, a[i], b);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        // C element e: row lane / 4 + 8 (e / 2), column 2 (lane % 4) + e % 2.
                        const Int8Scales xe = xs[i][e / 2];
                        const Int8Scales we = ws[e % 2];
                        const float dot = bits_to_float((unsigned int)dots[e]) - INT8_DOT_BIAS_FLOAT;
                        float v = fmaf(we.d * xe.d, dot, acc[i][j][e]);
                        if (F::has_min) {
                            v = fmaf(-we.s, xe.s, v);
                        }
                        acc[i][j][e] = v;
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < N8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = row0 + 16 * i + mma_sync_row(lane, e);
                const int n = col0 + 8 * j + mma_sync_col(lane, e);
                const int p = dst_row[m];
                if (p >= 0 && n0 + n < n_out) {
                    y[(long long)p * n_out + n0 + n] = acc[i][j][e] + tail[n];
                }
            }
        }
    }
}

#define MOE_MUL_MAT_ID_INT8(NAME, TYPE, TILE_M)                                                             \
    extern "C" __global__ void __launch_bounds__(MOE_INT8_THREADS, 2)                                       \
        NAME(const unsigned char* __restrict__ w, const unsigned char* __restrict__ xq,                     \
             const int* __restrict__ scratch, float* __restrict__ y, int n_expert, int n_out, int n_in,    \
             int top_k, int x_per_pair, int max_tiles) {                                                   \
        KERNEL_PROLOGUE();                                                                                 \
        mul_mat_id_int8_tile<TYPE, TILE_M>(w, xq, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair,   \
                                           max_tiles);                                                     \
    }

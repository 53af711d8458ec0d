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

// The start of every mul_mat_id block: the tile of blockIdx.y from the grouping scratch,
// its pairs' output rows (dst_row; -1 past the tile's count) and activation rows (src_row)
// staged in shared memory. Returns the tile's expert, or -1 when the block has nothing more
// to do: no tile (the grid is sized for the most tiles there can be), or the bucket of
// out-of-range ids, whose outputs it fills with NaN. Either way the whole block returns.
template <int TILE_M, int THREADS>
__device__ int begin_tile(const int* __restrict__ scratch, float* __restrict__ y, int* src_row, int* dst_row,
                          int n_expert, int n_out, int top_k, int x_per_pair, int max_tiles) {
    const int tile = blockIdx.y;
    if (tile >= scratch[0]) {
        return -1;
    }
    const int* entry = scratch + MOE_SCRATCH_HEADER + 3 * tile;
    const int expert = entry[0];
    const int first = entry[1];
    const int count = entry[2];
    const int* rows = scratch + MOE_SCRATCH_HEADER + 3 * max_tiles;
    const int tid = threadIdx.x;
    for (int m = tid; m < TILE_M; m += THREADS) {
        const int p = m < count ? rows[first + m] : -1;
        dst_row[m] = p;
        src_row[m] = p < 0 ? -1 : (x_per_pair ? p : p / top_k);
    }
    __syncthreads();
    if (expert == n_expert) {
        const int n0 = blockIdx.x * MOE_TILE_N;
        for (int i = tid; i < count * MOE_TILE_N; i += THREADS) {
            const int o = n0 + i % MOE_TILE_N;
            if (o < n_out) {
                y[(long long)dst_row[i / MOE_TILE_N] * n_out + o] = bits_to_float(0x7fc00000u);
            }
        }
        return -1;
    }
    return expert;
}

// Bytes of one weight row of n_in elements.
template <int TYPE>
__device__ long long weight_row_bytes(int n_in) {
    return BlockFormat<TYPE>::quantized
               ? (long long)(n_in / (MOE_TILE_K * BlockFormat<TYPE>::slices)) * BlockFormat<TYPE>::bytes
               : (long long)n_in * (BlockFormat<TYPE>::bytes / MOE_TILE_K);
}

template <int TYPE, int TILE_M>
__device__ void mul_mat_id_tile(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                const int* __restrict__ scratch, float* __restrict__ y, int n_expert,
                                int n_out, int n_in, int top_k, int x_per_pair, int max_tiles) {
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

    const int expert = begin_tile<TILE_M, MOE_MMID_THREADS>(scratch, y, src_row, dst_row, n_expert, n_out, top_k,
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
             int top_k, int x_per_pair, int max_tiles) {                                                \
        KERNEL_PROLOGUE();                                                                              \
        mul_mat_id_tile<TYPE, TILE_M>(w, x, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair,      \
                                      max_tiles);                                                       \
    }
// Instances (one per weight type and tile height of layout.FORMATS) are appended after the last
// file by kernel_source (program.py), for the types a module needs.

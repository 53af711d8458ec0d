// ---------------------------------------------------------------------------------
// Grouping: bucket the (token, k) pairs by expert and cut each bucket into tiles.
//
// scratch (int32): [0] number of tiles; from MOE_SCRATCH_HEADER, max_tiles triples
// (expert, first row, row count); then n_pairs row entries (pair index t * top_k + k)
// sorted by expert; then, per grouping block, its pairs' count in every bucket. Ids outside
// [0, n_expert) go to bucket n_expert, whose outputs the matrix kernel fills with NaN instead
// of reading memory out of range.
//
// Two launches of one block per MOE_GROUP_CHUNK pairs: moe_group_count counts each block's
// pairs per bucket, moe_group_place works out where each block's pairs of a bucket go (after
// the earlier blocks' pairs of that bucket), writes the tile table (block 0) and places its
// pairs. One block grouping every pair took 43 us for 32768 pairs on an H200 (ubatch 4096),
// whether or not its threads loaded their ids eight at a time; the two launches take 10. The
// order of pairs inside a block's
// share of a bucket depends on atomics; no output value depends on it, because every output
// element is one thread's dot product in a fixed order.
// ---------------------------------------------------------------------------------

#define MOE_GROUP_RUN 8  // pairs whose ids a grouping thread loads at once

__device__ int bucket_of(int id, int n_expert) {
    return (unsigned int)id < (unsigned int)n_expert ? id : n_expert;
}

// This block's count of pairs in every bucket, in the scratch after the row entries.
__device__ int* group_counts(int* scratch, int n_pairs, int max_tiles, int n_buckets, int block) {
    return scratch + MOE_SCRATCH_HEADER + 3 * max_tiles + n_pairs + block * n_buckets;
}

// Every pair of this grouping block advances its bucket's counter by one; with PLACE, the pair's
// index goes to rows where the counter stood. Each thread loads MOE_GROUP_RUN ids before their
// atomics.
template <bool PLACE>
__device__ void group_block_pairs(const int* __restrict__ ids, int n_pairs, int n_expert, int* counter, int* rows) {
    const int begin = blockIdx.x * MOE_GROUP_CHUNK;
    const int end = min(begin + MOE_GROUP_CHUNK, n_pairs);
    for (int first = begin + threadIdx.x; first < end; first += MOE_GROUP_RUN * blockDim.x) {
        int bucket[MOE_GROUP_RUN];
#pragma unroll
        for (int i = 0; i < MOE_GROUP_RUN; ++i) {
            const int p = first + i * (int)blockDim.x;
            bucket[i] = p < end ? bucket_of(ids[p], n_expert) : -1;
        }
#pragma unroll
        for (int i = 0; i < MOE_GROUP_RUN; ++i) {
            if (bucket[i] >= 0) {
                const int at = atomicAdd(&counter[bucket[i]], 1);
                if (PLACE) {
                    rows[at] = first + i * (int)blockDim.x;
                }
            }
        }
    }
}

// a[0..n) becomes its exclusive prefix sums; tmp holds n ints; every thread of the block calls it.
__device__ void block_exclusive_scan(int* a, int* tmp, int n) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        tmp[e] = a[e];
    }
    __syncthreads();
    for (int step = 1; step < n; step *= 2) {  // then tmp[e] sums a over the 2 step elements up to e
        int sum[(MOE_MAX_EXPERTS + MOE_GROUP_THREADS) / MOE_GROUP_THREADS];
        for (int i = 0, e = threadIdx.x; e < n; ++i, e += blockDim.x) {
            sum[i] = tmp[e] + (e >= step ? tmp[e - step] : 0);
        }
        __syncthreads();
        for (int i = 0, e = threadIdx.x; e < n; ++i, e += blockDim.x) {
            tmp[e] = sum[i];
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        a[e] = tmp[e] - a[e];
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group_count(const int* __restrict__ ids, int* __restrict__ scratch, int n_pairs, int n_expert, int max_tiles) {
    KERNEL_PROLOGUE();
    __shared__ int count[MOE_MAX_EXPERTS + 1];
    const int n_buckets = n_expert + 1;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        count[e] = 0;
    }
    __syncthreads();
    group_block_pairs<false>(ids, n_pairs, n_expert, count, 0);
    __syncthreads();
    int* counts = group_counts(scratch, n_pairs, max_tiles, n_buckets, blockIdx.x);
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        counts[e] = count[e];
    }
}

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group_place(const int* __restrict__ ids, int* __restrict__ scratch, int n_pairs, int n_expert, int tile_m,
                    int max_tiles) {
    KERNEL_PROLOGUE();
    __shared__ int first_row[MOE_MAX_EXPERTS + 1];   // of each bucket
    __shared__ int first_tile[MOE_MAX_EXPERTS + 1];  // of each bucket
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];      // where this block's next pair of each bucket goes
    __shared__ int tmp[MOE_MAX_EXPERTS + 1];
    const int n_buckets = n_expert + 1;
    int* rows = scratch + MOE_SCRATCH_HEADER + 3 * max_tiles;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        int total = 0;
        int before = 0;  // the earlier blocks' pairs of the bucket
        for (int b = 0; b < (int)gridDim.x; ++b) {
            const int c = group_counts(scratch, n_pairs, max_tiles, n_buckets, b)[e];
            before += b < (int)blockIdx.x ? c : 0;
            total += c;
        }
        first_row[e] = total;
        first_tile[e] = (total + tile_m - 1) / tile_m;
        cursor[e] = before;
    }
    __syncthreads();
    const int last_tiles = first_tile[n_buckets - 1];  // the scans below leave what comes before it
    block_exclusive_scan(first_row, tmp, n_buckets);
    block_exclusive_scan(first_tile, tmp, n_buckets);
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        cursor[e] += first_row[e];
    }
    if (blockIdx.x == 0) {
        int* tile_table = scratch + MOE_SCRATCH_HEADER;
        for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
            const int count = (e + 1 < n_buckets ? first_row[e + 1] : n_pairs) - first_row[e];
            int t = first_tile[e];
            for (int begin = 0; begin < count; begin += tile_m, ++t) {
                tile_table[3 * t] = e;
                tile_table[3 * t + 1] = first_row[e] + begin;
                tile_table[3 * t + 2] = count - begin < tile_m ? count - begin : tile_m;
            }
        }
        if (threadIdx.x == 0) {
            scratch[0] = first_tile[n_buckets - 1] + last_tiles;
        }
    }
    __syncthreads();
    group_block_pairs<true>(ids, n_pairs, n_expert, cursor, rows);
}

// Stream.gather_h2d on CUDA and HIP: the device copies the rows its routing ids name from
// page-locked host memory it reads over the link, so the host never reads the ids first.
//
// Grid: x = chunks of a row (with its overrun), y = one block row per id. A block whose id
// names no row, or names one an earlier id already names, copies nothing: each row is copied
// once, whatever the ids repeat. An id naming no row is reported, where the caller asks: the
// first launch to meet one writes its tag and the id into report[0] and report[1] (report[0]
// must hold -1 before). An id among the n_skip ids of skip is not copied: its row is there
// already (a decode step's predicted experts, gathered ahead of the router).
//
// Packed (packed != 0): the rows go one after another instead of at their own offsets. The row
// of the id first met at position j goes to row n_skip + j of dst, without its overrun (the next
// row there is another expert's); a skipped id's row is at row p, its first position in skip,
// where a packed gather of the skipped ids put it. A row n_skip + j that no row goes to (a
// repeated, skipped or bad id at j) gets its first overrun bytes zeroed: what a kernel reads past
// the row before it. slots[j] (where given) receives the row of dst that the id at j is at, for
// kernels to index dst by; 0 for an id naming no row.

// Chained launches: as the kernels' formats.cu says (this file is compiled on its own).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP_PLATFORM_AMD__)
#define KERNEL_PROLOGUE() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define KERNEL_PROLOGUE() ((void)0)
#endif

#define GATHER_CHUNK_BYTES 32768ull
#define GATHER_IN_FLIGHT 4  // 16-byte loads each thread has outstanding before it stores

struct alignas(16) GatherWords {
    unsigned int x, y, z, w;
};

__device__ __forceinline__ void gather_bytes(unsigned char* to, const unsigned char* from, unsigned long long n) {
    const unsigned long long step = blockDim.x;
    unsigned long long head = 0;
    unsigned long long words = 0;
    if ((((unsigned long long)to ^ (unsigned long long)from) & 15ull) == 0) {
        head = (16ull - ((unsigned long long)from & 15ull)) & 15ull;
        head = head < n ? head : n;
        words = (n - head) / 16ull;
    }
    for (unsigned long long i = threadIdx.x; i < head; i += step) {
        to[i] = from[i];
    }
    const GatherWords* src = (const GatherWords*)(from + head);
    GatherWords* dst = (GatherWords*)(to + head);
    for (unsigned long long base = threadIdx.x; base < words; base += step * GATHER_IN_FLIGHT) {
        GatherWords held[GATHER_IN_FLIGHT];
#pragma unroll
        for (int k = 0; k < GATHER_IN_FLIGHT; ++k) {
            const unsigned long long i = base + k * step;
            if (i < words) {
                held[k] = src[i];
            }
        }
#pragma unroll
        for (int k = 0; k < GATHER_IN_FLIGHT; ++k) {
            const unsigned long long i = base + k * step;
            if (i < words) {
                dst[i] = held[k];
            }
        }
    }
    for (unsigned long long i = head + words * 16ull + threadIdx.x; i < n; i += step) {
        to[i] = from[i];
    }
}

extern "C" __global__ void expertstream_gather_rows(
    unsigned char* dst,
    const unsigned char* src,  // the device's address of the host region
    const int* ids,
    int first,  // the id of this launch's first block row (grids hold at most 65535 rows)
    unsigned long long nbytes,
    unsigned long long row_bytes,
    unsigned long long overrun,
    int* report,  // null: not asked
    int tag,
    const int* skip,  // null where n_skip is 0
    int n_skip,
    // packed: rows one after another (above); slots: null where not asked (packed only)
    int packed,
    int* slots) {
    KERNEL_PROLOGUE();
    const int j = first + (int)blockIdx.y;
    const int id = ids[j];
    int slot = n_skip + j;
    bool copies = false;
    if (id < 0 || (unsigned long long)id >= nbytes / row_bytes) {
        if (report != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && atomicCAS(report, -1, tag) == -1) {
            report[1] = id;
        }
        slot = 0;
    } else {
        int hit = -1;  // the id's first position among the skipped ids
        for (int k = 0; k < n_skip && hit < 0; ++k) {
            hit = skip[k] == id ? k : -1;
        }
        int met = j;  // the id's first position in ids
        for (int k = 0; k < j && hit < 0; ++k) {
            if (ids[k] == id) {
                met = k;
                break;
            }
        }
        slot = hit >= 0 ? hit : n_skip + met;
        copies = hit < 0 && met == j;
    }
    if (slots != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        slots[j] = slot;
    }
    if (!copies) {
        if (packed && blockIdx.x == 0) {
            // Row n_skip + j stays unwritten: zero the bytes a kernel reads past the row before it,
            // which would otherwise be whatever the scratch held (another type's bytes, NaN scales).
            unsigned char* row = dst + (unsigned long long)(n_skip + j) * row_bytes;
            const unsigned long long n = overrun < row_bytes ? overrun : row_bytes;
            for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
                row[i] = 0;
            }
        }
        return;
    }
    const unsigned long long start = (unsigned long long)id * row_bytes;
    unsigned long long end = start + row_bytes + (packed ? 0ull : overrun);
    end = end < nbytes ? end : nbytes;
    const unsigned long long lo = start + (unsigned long long)blockIdx.x * GATHER_CHUNK_BYTES;
    if (lo >= end) {
        return;
    }
    const unsigned long long hi = lo + GATHER_CHUNK_BYTES < end ? lo + GATHER_CHUNK_BYTES : end;
    const unsigned long long to = packed ? (unsigned long long)(n_skip + j) * row_bytes + (lo - start) : lo;
    gather_bytes(dst + to, src + lo, hi - lo);
}

// Timing harness for the matrix-vector kernels: appended to the kernel source (gemv instances only).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>
#include <algorithm>
#include <string>
#include <cuda_runtime.h>

#define CEIL(a, b) (((a) + (b) - 1) / (b))
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__global__ void fill_bytes(unsigned int* p, size_t words, unsigned int seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        p[i] = h;
    }
}
// set the half scales at byte offsets `at` (count n) of each block of `bytes` to small positive values
__global__ void fix_scales(unsigned char* p, size_t blocks, int bytes, int at, int n) {
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < blocks; b += (size_t)gridDim.x * blockDim.x) {
        for (int j = 0; j < n; ++j) {
            unsigned short v = (unsigned short)(0x1800 | ((b * 7 + j * 13) & 0x3ff));
            p[b * bytes + at + 2 * j] = v & 0xff;
            p[b * bytes + at + 2 * j + 1] = v >> 8;
        }
    }
}
__global__ void fill_floats(float* p, size_t n, unsigned int seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = ((h & 0xffff) / 32768.0f - 1.0f);
    }
}

struct Type { const char* name; int block_elems; int block_bytes; int scale_at; int scale_n; };
static const Type Q4K = {"Q4_K", 256, 144, 0, 2};
static const Type Q6K = {"Q6_K", 256, 210, 208, 1};

static size_t row_bytes(const Type& t, int n_in) { return (size_t)n_in / t.block_elems * t.block_bytes; }

static unsigned char* weights(const Type& t, size_t rows, int n_in, unsigned int seed) {
    size_t bytes = rows * row_bytes(t, n_in) + 4096;  // + padding tail room
    unsigned char* p;
    CK(cudaMalloc(&p, bytes));
    fill_bytes<<<1024, 256>>>((unsigned int*)p, bytes / 4, seed);
    fix_scales<<<1024, 256>>>(p, rows * row_bytes(t, n_in) / t.block_bytes, t.block_bytes, t.scale_at, t.scale_n);
    CK(cudaGetLastError());
    return p;
}

static bool g_pdl = false;
static bool g_ncu = false;  // each case launched once, outside graphs, for a profiler
// The output buffers, filled with 0xFF bytes (NaN) before the run whose output is hashed: a row a kernel
// leaves unwritten then shows, instead of holding an earlier case's bytes.
static std::vector<std::pair<void*, size_t>> g_outputs;
static void poison(cudaStream_t s) {
    for (auto& out : g_outputs) CK(cudaMemsetAsync(out.first, 0xff, out.second, s));
}
template <typename... K, typename... A>
static void launch(void (*kernel)(K...), dim3 grid, dim3 block, cudaStream_t s, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = block; cfg.stream = s; cfg.dynamicSmemBytes = 0;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr; cfg.numAttrs = g_pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static unsigned long long fnv(const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p; unsigned long long h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 1099511628211ull; }
    return h;
}

// time `n` launches of f(i) captured in one graph; returns seconds per launch (median of 7 replays)
template <typename F> static double time_graph(cudaStream_t s, int n, F f) {
    if (g_ncu) {
        poison(s);
        f(0);
        CK(cudaStreamSynchronize(s));
        return 1.0;
    }
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) f(i);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
        float t; CK(cudaEventElapsedTime(&t, a, b)); ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    poison(s);  // then one more replay, untimed, whose output is hashed
    CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    return ms[3] / 1e3 / n;
}

int main(int argc, char** argv) {
    const char* variant = argc > 1 ? argv[1] : "?";
    g_pdl = argc > 2 && !strcmp(argv[2], "pdl");
    g_ncu = argc > 2 && !strcmp(argv[2], "ncu");
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int E = 128, K = 8, N = 64;
    // ids: launch i uses experts (16 * k + i) % 128: consecutive launches share none, 16 cover all
    std::vector<int> h_ids(N * K);
    for (int i = 0; i < N; ++i) for (int k = 0; k < K; ++k) h_ids[i * K + k] = (16 * k + i * 5) % E;
    int* ids; CK(cudaMalloc(&ids, N * K * sizeof(int)));
    CK(cudaMemcpy(ids, h_ids.data(), N * K * sizeof(int), cudaMemcpyHostToDevice));
    float *x, *y, *gate; CK(cudaMalloc(&x, 1 << 24)); CK(cudaMalloc(&y, 1 << 24)); CK(cudaMalloc(&gate, 1 << 24));
    fill_floats<<<256, 256>>>(x, (1 << 24) / 4, 7u);
    float* ybig; CK(cudaMalloc(&ybig, 151936 * 4 * 2));
    g_outputs = {{y, 1 << 24}, {ybig, 151936 * 4 * 2}};
    std::vector<char> host(1 << 24);
    auto report = [&](const char* what, double sec, double bytes, const void* out, size_t out_bytes) {
        CK(cudaMemcpy(host.data(), out, out_bytes, cudaMemcpyDeviceToHost));
        printf("%-8s %-4s %-22s %9.2f us %8.2f MB %7.0f GB/s  out %016llx\n", variant, g_pdl ? "pdl" : "-", what, sec * 1e6,
               bytes / 1e6, bytes / sec / 1e9, fnv(host.data(), out_bytes));
        fflush(stdout);
    };
    const Type* types[2] = {&Q4K, &Q6K};
    for (const Type* t : types) {
        const bool q4 = t == &Q4K;
        // gate+up: [E][768][2048] each
        unsigned char* wg = weights(*t, (size_t)E * 768, 2048, 1u);
        unsigned char* wu = weights(*t, (size_t)E * 768, 2048, 2u);
        double sec = time_graph(s, N, [&](int i) {
            auto k = q4 ? moe_gate_up_vec_id_q4_k : moe_gate_up_vec_id_q6_k;
            launch(k, dim3(CEIL(768, MOE_GEMV_GATE_UP_ROWS), K), dim3(MOE_GEMV_THREADS), s, (const unsigned char*)wg, (const unsigned char*)wu, (const float*)x,
                   (const int*)(ids + i * K), y, E, 768, 2048, K, K);
        });
        report((std::string(t->name) + " gate+up x8").c_str(), sec, 2.0 * K * 768 * row_bytes(*t, 2048), y, K * 768 * 4);
        CK(cudaFree(wg)); CK(cudaFree(wu));
        // down: [E][2048][768], one x row per pair
        unsigned char* wd = weights(*t, (size_t)E * 2048, 768, 3u);
        sec = time_graph(s, N, [&](int i) {
            auto k = q4 ? moe_mul_mat_vec_id_q4_k : moe_mul_mat_vec_id_q6_k;
            launch(k, dim3(CEIL(2048, MOE_GEMV_ROWS), K), dim3(MOE_GEMV_THREADS), s, (const unsigned char*)wd, (const float*)x, (const int*)(ids + i * K), y, E,
                   2048, 768, K, 1, K, (const float*)nullptr, (const float*)nullptr);
        });
        report((std::string(t->name) + " down x8").c_str(), sec, 1.0 * K * 2048 * row_bytes(*t, 768), y, K * 2048 * 4);
        CK(cudaFree(wd));
        // dense: 16 layers of q/k/v parts [4096|512|512][2048] and o [2048][4096]
        const int L = 16;
        unsigned char *wq = weights(*t, (size_t)L * 4096, 2048, 4u), *wk = weights(*t, (size_t)L * 512, 2048, 5u),
                      *wv = weights(*t, (size_t)L * 512, 2048, 6u), *wo = weights(*t, (size_t)L * 2048, 4096, 7u);
        float *yq = y, *yk = y + 4096, *yv = y + 4608;
        sec = time_graph(s, N, [&](int i) {
            const int l = i % L;
            auto k = q4 ? moe_mul_mat_vec_parts_q4_k : moe_mul_mat_vec_parts_q6_k;
            launch(k, dim3(CEIL(4096, MOE_GEMV_ROWS), 3), dim3(MOE_GEMV_THREADS), s, (const unsigned char*)(wq + l * 4096 * row_bytes(*t, 2048)),
                   (const unsigned char*)(wk + l * 512 * row_bytes(*t, 2048)), (const unsigned char*)(wv + l * 512 * row_bytes(*t, 2048)),
                   (const float*)x, yq, yk, yv, 4096, 512, 512, 2048, 1);
        });
        report((std::string(t->name) + " qkv").c_str(), sec, 5120.0 * row_bytes(*t, 2048), y, 5120 * 4);
        sec = time_graph(s, N, [&](int i) {
            const int l = i % L;
            auto k = q4 ? moe_mul_mat_vec_id_q4_k : moe_mul_mat_vec_id_q6_k;
            launch(k, dim3(CEIL(2048, MOE_GEMV_ROWS), 1), dim3(MOE_GEMV_THREADS), s, (const unsigned char*)(wo + l * 2048 * row_bytes(*t, 4096)), (const float*)x,
                   (const int*)ids, y, 1, 2048, 4096, 1, 0, 1, (const float*)nullptr, (const float*)nullptr);
        });
        // ids[0] must be 0 for one expert: launch 0's first id is 0
        report((std::string(t->name) + " o").c_str(), sec, 2048.0 * row_bytes(*t, 4096), y, 2048 * 4);
        CK(cudaFree(wq)); CK(cudaFree(wk)); CK(cudaFree(wv)); CK(cudaFree(wo));
        if (!q4) {  // the output head [151936][2048]
            unsigned char* wh = weights(*t, 151936, 2048, 8u);
            sec = time_graph(s, 8, [&](int) {
                launch(moe_mul_mat_vec_id_q6_k, dim3(CEIL(151936, MOE_GEMV_ROWS), 1), dim3(MOE_GEMV_THREADS), s, (const unsigned char*)wh, (const float*)x,
                       (const int*)ids, ybig, 1, 151936, 2048, 1, 0, 1, (const float*)nullptr, (const float*)nullptr);
            });
            report("Q6_K head", sec, 151936.0 * row_bytes(*t, 2048), ybig, 151936 * 4);
            CK(cudaFree(wh));
        }
    }
    // plain copies: 14 MB (read + write counted) and 1 GiB
    for (size_t bytes : {(size_t)14155776, (size_t)1 << 30}) {
        unsigned char *a, *b; CK(cudaMalloc(&a, bytes * 4)); CK(cudaMalloc(&b, bytes * 4));
        const int n = bytes < (1u << 28) ? 64 : 4;
        double sec = time_graph(s, n, [&](int i) { CK(cudaMemcpyAsync(b + (i % 4) * bytes, a + (i % 4) * bytes, bytes, cudaMemcpyDeviceToDevice, s)); });
        printf("%-8s %-4s copy %-17zu %9.2f us %8.2f MB %7.0f GB/s  (read+write)\n", variant, g_pdl ? "pdl" : "-", bytes, sec * 1e6, 2.0 * bytes / 1e6,
               2.0 * bytes / sec / 1e9);
        CK(cudaFree(a)); CK(cudaFree(b));
    }
    return 0;
}

// Count the experts llama.cpp's own forward pass routes tokens to, per MoE layer and ubatch.
//
// Loads a GGUF model with libllama (CPU), decodes random prompt tokens one ubatch at a time (as
// llama-bench's prompt test does, but asking for every token's output so that the last layer's
// MoE sees the whole ubatch), and reads the expert ids of the graph tensors "ffn_moe_topk-<layer>"
// through the scheduler's evaluation callback.
//
// usage: llamacpp-routing MODEL.gguf UBATCH [N_UBATCH=1] [SEED=0] [THREADS=2]
// prints one line per (ubatch, MoE layer):
//     ubatch <u> layer <il> used <distinct> of <n_expert> tokens <ubatch> max_share <s>
// where max_share is the busiest expert's share of the ubatch's (token, slot) pairs.
// ROUTING_DESCRIBE=ffn_inp,ffn_moe_out,... also prints, for each F32 graph tensor of those names,
// its RMS and the part all tokens share:  tensor <name-layer> rms <r> shared <s>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

const char * const TOPK_PREFIX = "ffn_moe_topk-";

struct Counts {
    std::map<int, std::vector<long>> per_layer;  // layer -> tokens routed to each expert
    std::vector<std::string> watched;           // tensor names (without "-<layer>") to describe
};

// "name-12" -> "name"
std::string base_name(const char * name) {
    const char * dash = std::strrchr(name, '-');
    return dash == nullptr ? std::string(name) : std::string(name, dash - name);
}

bool is_watched(const Counts & counts, const ggml_tensor * t) {
    if (t->type != GGML_TYPE_F32 || t->ne[2] != 1 || t->ne[3] != 1) {
        return false;
    }
    const std::string name = base_name(t->name);
    for (const std::string & w : counts.watched) {
        if (w == name) {
            return true;
        }
    }
    return false;
}

// One line on a [features, tokens] F32 tensor: each token's RMS (mean), and how much of it all
// tokens share: |mean over tokens| / RMS over tokens (0: no shared part, 1: every token the same).
void describe(const ggml_tensor * t) {
    const int64_t n = t->ne[0];
    const int64_t n_tokens = t->ne[1];
    std::vector<float> row(n);
    std::vector<double> mean(n, 0.0);
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n_tokens; ++i) {
        ggml_backend_tensor_get(t, row.data(), i * t->nb[1], n * sizeof(float));
        for (int64_t j = 0; j < n; ++j) {
            mean[j] += row[j];
            sum_sq += static_cast<double>(row[j]) * row[j];
        }
    }
    double mean_sq = 0.0;
    for (double m : mean) {
        mean_sq += (m / n_tokens) * (m / n_tokens);
    }
    const double rms = std::sqrt(sum_sq / (n * n_tokens));
    std::printf("tensor %s rms %.4g shared %.3f\n", t->name, rms, rms > 0 ? std::sqrt(mean_sq / n) / rms : 0.0);
}

bool is_topk(const ggml_tensor * t) {
    return std::strncmp(t->name, TOPK_PREFIX, std::strlen(TOPK_PREFIX)) == 0;
}

// Scheduler callback: ask for the top-k tensors only, then tally their expert ids.
bool on_tensor(ggml_tensor * t, bool ask, void * user_data) {
    auto * counts = static_cast<Counts *>(user_data);
    if (is_watched(*counts, t)) {
        if (!ask) {
            describe(t);
        }
        return true;
    }
    if (!is_topk(t)) {
        return false;
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_I32) {
        std::fprintf(stderr, "%s: expected I32 ids, got %s\n", t->name, ggml_type_name(t->type));
        std::exit(2);
    }
    // the top-k tensor views the first k columns of the argsort result: each token's k ids at its row stride
    const int64_t k = t->ne[0];
    const int64_t n_tokens = t->ne[1];
    std::vector<int32_t> ids(k);
    const int layer = std::atoi(t->name + std::strlen(TOPK_PREFIX));
    std::vector<long> & used = counts->per_layer[layer];
    for (int64_t row = 0; row < n_tokens; ++row) {
        ggml_backend_tensor_get(t, ids.data(), row * t->nb[1], k * sizeof(int32_t));
        for (int32_t id : ids) {
            if (id < 0) {
                continue;
            }
            if (static_cast<size_t>(id) >= used.size()) {
                used.resize(id + 1, 0);
            }
            used[id] += 1;
        }
    }
    return true;
}

// An integer metadata value of the model's architecture ("<arch>.<key>"), or -1.
int arch_int(const llama_model * model, const char * key) {
    char arch[64];
    char value[64];
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch) < 0) {
        return -1;
    }
    const std::string name = std::string(arch) + "." + key;
    if (llama_model_meta_val_str(model, name.c_str(), value, sizeof value) < 0) {
        return -1;
    }
    return std::atoi(value);
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s MODEL.gguf UBATCH [N_UBATCH=1] [SEED=0] [THREADS=2]\n", argv[0]);
        return 1;
    }
    const char * path = argv[1];
    const int ubatch = std::atoi(argv[2]);
    const int n_ubatch = argc > 3 ? std::atoi(argv[3]) : 1;
    const unsigned seed = argc > 4 ? static_cast<unsigned>(std::atoi(argv[4])) : 0;
    const int threads = argc > 5 ? std::atoi(argv[5]) : 2;
    if (ubatch < 1 || n_ubatch < 1 || threads < 1) {
        std::fprintf(stderr, "UBATCH, N_UBATCH and THREADS must be positive\n");
        return 1;
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    // weights straight from the mapped file: repacking them for the CPU would copy the whole model
    // into anonymous memory, twice the file's size in all
    mparams.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(path, mparams);
    if (model == nullptr) {
        std::fprintf(stderr, "%s: llama.cpp cannot load it\n", path);
        return 1;
    }

    const int n_expert = arch_int(model, "expert_count");
    Counts counts;
    if (const char * watch = std::getenv("ROUTING_DESCRIBE")) {
        for (const char * p = watch; *p != '\0';) {
            const char * comma = std::strchr(p, ',');
            const size_t len = comma == nullptr ? std::strlen(p) : static_cast<size_t>(comma - p);
            counts.watched.emplace_back(p, len);
            p += len + (comma != nullptr);
        }
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = static_cast<uint32_t>(ubatch) * n_ubatch;
    cparams.n_batch = ubatch;
    cparams.n_ubatch = ubatch;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.cb_eval = on_tensor;
    cparams.cb_eval_user_data = &counts;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        std::fprintf(stderr, "%s: cannot create a context of %d tokens\n", path, ubatch * n_ubatch);
        return 1;
    }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> token(0, n_vocab - 1);
    llama_batch batch = llama_batch_init(ubatch, 0, 1);
    for (int u = 0; u < n_ubatch; ++u) {
        batch.n_tokens = ubatch;
        for (int i = 0; i < ubatch; ++i) {
            batch.token[i] = token(rng);
            batch.pos[i] = u * ubatch + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;  // every token's output: the last layer then routes all of them
        }
        counts.per_layer.clear();
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed at ubatch %d\n", u);
            return 1;
        }
        if (counts.per_layer.empty()) {
            std::fprintf(stderr, "no ffn_moe_topk tensors seen: not an MoE model?\n");
            return 1;
        }
        for (const auto & [layer, used] : counts.per_layer) {
            long total = 0;
            long busiest = 0;
            int distinct = 0;
            for (long c : used) {
                total += c;
                busiest = c > busiest ? c : busiest;
                distinct += c > 0;
            }
            std::printf("ubatch %d layer %d used %d of %d tokens %d max_share %.4f\n", u, layer, distinct, n_expert,
                        ubatch, total ? static_cast<double>(busiest) / total : 0.0);
        }
        std::fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

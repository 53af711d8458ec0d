// Record llama.cpp's logits over a prompt and a greedy continuation, for comparing with other runs.
//
// usage: llamacpp-logits -m MODEL --tokens FILE --n-prompt N --n-gen G [--ngl 0|99] [--ubatch U]
//                        [--ctx C] [--threads T] [--fa auto|on|off] -o OUT_PREFIX
//
// FILE holds token ids, one per line, at least N. The first N are decoded as the prompt, U at a
// time, with logits for every position; then G greedy steps decode one token each: the argmax of
// the last row (first index of the maximum) is fed back at the next position. So N + G tokens are
// fed at positions 0 .. N+G-1, positions N .. N+G-1 being the generated ones, and row i of the
// logits is the next-token distribution after position i (the last row's argmax is not fed).
//
// --fa defaults to off: with flash attention on, llama.cpp's CPU logits for the same tokens
// changed with the ubatch size (docs/results/llamacpp-logits-cpu.md); without it they did not.
//
// Writes OUT_PREFIX.logits (float32, row-major [N+G, n_vocab], native byte order),
// OUT_PREFIX.tokens (the N+G fed ids, one per line) and OUT_PREFIX.json (shapes, settings, build).
// --ngl 0 computes on the CPU only: no GPU device is given to the model, the KV cache stays in
// host memory, and op_offload is off, so the scheduler does not ship large matmuls to a GPU.
// CPU weights are used as the file holds them (no repacking; see main).

#include "ggml-backend.h"
#include "llama.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
    std::string model;
    std::string tokens;
    std::string out;
    int n_prompt = -1;
    int n_gen = -1;
    int ngl = 0;
    int ubatch = 512;
    int ctx = 0;  // 0: N + G
    int threads = 0;  // 0: every hardware thread
    std::string fa = "off";
};

[[noreturn]] void fail(const std::string & message) {
    std::fprintf(stderr, "llamacpp-logits: %s\n", message.c_str());
    std::exit(2);
}

const char * const USAGE =
    "usage: llamacpp-logits -m MODEL --tokens FILE --n-prompt N --n-gen G [--ngl 0|99] [--ubatch U]\n"
    "                       [--ctx C] [--threads T] [--fa auto|on|off] -o OUT_PREFIX\n";

int parse_int(const std::string & flag, const char * text) {
    char * end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || value < 0 || value > 1 << 30) {
        fail(flag + " takes a non-negative integer, got '" + text + "'");
    }
    return static_cast<int>(value);
}

Options parse(int argc, char ** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "-h" || flag == "--help") {
            std::fputs(USAGE, stdout);
            std::exit(0);
        }
        if (i + 1 >= argc) {
            fail(flag + " needs a value\n" + USAGE);
        }
        const char * value = argv[++i];
        if (flag == "-m" || flag == "--model") {
            o.model = value;
        } else if (flag == "--tokens") {
            o.tokens = value;
        } else if (flag == "-o") {
            o.out = value;
        } else if (flag == "--n-prompt") {
            o.n_prompt = parse_int(flag, value);
        } else if (flag == "--n-gen") {
            o.n_gen = parse_int(flag, value);
        } else if (flag == "--ngl") {
            o.ngl = parse_int(flag, value);
        } else if (flag == "--ubatch") {
            o.ubatch = parse_int(flag, value);
        } else if (flag == "--ctx") {
            o.ctx = parse_int(flag, value);
        } else if (flag == "--threads") {
            o.threads = parse_int(flag, value);
        } else if (flag == "--fa") {
            o.fa = value;
        } else {
            fail("unknown option " + flag + "\n" + USAGE);
        }
    }
    if (o.model.empty() || o.tokens.empty() || o.out.empty() || o.n_prompt < 0 || o.n_gen < 0) {
        fail(std::string("-m, --tokens, --n-prompt, --n-gen and -o are required\n") + USAGE);
    }
    if (o.n_prompt < 1) {
        fail("--n-prompt must be at least 1");
    }
    if (o.ubatch < 1) {
        fail("--ubatch must be at least 1");
    }
    if (o.fa != "auto" && o.fa != "on" && o.fa != "off") {
        fail("--fa takes auto, on or off, got '" + o.fa + "'");
    }
    if (o.ctx == 0) {
        o.ctx = o.n_prompt + o.n_gen;
    }
    if (o.ctx < o.n_prompt + o.n_gen) {
        fail("--ctx " + std::to_string(o.ctx) + " is smaller than --n-prompt + --n-gen (" +
             std::to_string(o.n_prompt + o.n_gen) + ")");
    }
    if (o.threads == 0) {
        o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
    return o;
}

std::vector<llama_token> read_tokens(const std::string & path, int n_needed, int n_vocab) {
    std::ifstream in(path);
    if (!in) {
        fail("cannot read " + path);
    }
    std::vector<llama_token> ids;
    std::string line;
    for (int number = 1; std::getline(in, line) && static_cast<int>(ids.size()) < n_needed; ++number) {
        if (line.empty()) {
            continue;
        }
        char * end = nullptr;
        const long id = std::strtol(line.c_str(), &end, 10);
        if (end == line.c_str() || (*end != '\0' && *end != '\r') || id < 0 || id >= n_vocab) {
            fail(path + ":" + std::to_string(number) + ": '" + line + "' is not a token id in 0.." +
                 std::to_string(n_vocab - 1));
        }
        ids.push_back(static_cast<llama_token>(id));
    }
    if (static_cast<int>(ids.size()) < n_needed) {
        fail(path + " holds " + std::to_string(ids.size()) + " token ids; --n-prompt asks for " +
             std::to_string(n_needed));
    }
    return ids;
}

// Decode tokens[first .. first+count) at their positions, logits for each; append the rows.
void decode(llama_context * ctx, llama_batch & batch, const std::vector<llama_token> & tokens, int first, int count,
            int n_vocab, std::vector<float> & rows) {
    batch.n_tokens = count;
    for (int i = 0; i < count; ++i) {
        batch.token[i] = tokens[first + i];
        batch.pos[i] = first + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    if (llama_decode(ctx, batch) != 0) {
        fail("llama_decode failed at positions " + std::to_string(first) + ".." + std::to_string(first + count - 1));
    }
    for (int i = 0; i < count; ++i) {
        const float * logits = llama_get_logits_ith(ctx, i);
        if (logits == nullptr) {
            fail("no logits for position " + std::to_string(first + i));
        }
        rows.insert(rows.end(), logits, logits + n_vocab);
    }
}

llama_token argmax(const float * row, int n_vocab) {
    return static_cast<llama_token>(std::max_element(row, row + n_vocab) - row);
}

std::string json_string(const std::string & text) {
    std::string out = "\"";
    for (const unsigned char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            char escaped[8];
            std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
            out += escaped;
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

const char * device_type_name(enum ggml_backend_dev_type type) {
    switch (type) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:
            return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:
            return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:
            return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL:
            return "accel";
        default:
            return "other";
    }
}

// Where libllama was loaded from: which build produced the numbers.
std::string library_path() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&llama_backend_init), &info) == 0 || info.dli_fname == nullptr) {
        return "unknown";
    }
    return info.dli_fname;
}

void write_json(const Options & o, const llama_model * model, const llama_context * ctx, int n_vocab,
                const std::vector<llama_token> & fed, bool op_offload) {
    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    std::string devices = "[";
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        devices += std::string(i ? ", " : "") + "{\"name\": " + json_string(ggml_backend_dev_name(dev)) +
                   ", \"description\": " + json_string(ggml_backend_dev_description(dev)) +
                   ", \"type\": " + json_string(device_type_name(ggml_backend_dev_type(dev))) + "}";
    }
    devices += "]";
    std::string generated = "[";
    for (size_t i = o.n_prompt; i < fed.size(); ++i) {
        generated += (i > static_cast<size_t>(o.n_prompt) ? ", " : "") + std::to_string(fed[i]);
    }
    generated += "]";
    std::ofstream out(o.out + ".json");
    out << "{\n"
        << "  \"model\": " << json_string(o.model) << ",\n"
        << "  \"model_desc\": " << json_string(desc) << ",\n"
        << "  \"n_vocab\": " << n_vocab << ",\n"
        << "  \"n_prompt\": " << o.n_prompt << ",\n"
        << "  \"n_gen\": " << o.n_gen << ",\n"
        << "  \"shape\": [" << fed.size() << ", " << n_vocab << "],\n"
        << "  \"dtype\": \"float32\",\n"
        << "  \"rows\": " << json_string("row i: next-token logits after position i; positions 0..n_prompt-1 are the "
                                         "prompt, n_prompt..n_prompt+n_gen-1 the greedy tokens fed back")
        << ",\n"
        << "  \"generated\": " << generated << ",\n"
        << "  \"settings\": {\"ngl\": " << o.ngl << ", \"ubatch\": " << o.ubatch << ", \"ctx\": " << llama_n_ctx(ctx)
        << ", \"threads\": " << o.threads << ", \"flash_attn\": " << json_string(o.fa)
        << ", \"op_offload\": " << (op_offload ? "true" : "false") << ", \"cpu_repack\": false"
        << ", \"gpu_devices\": " << json_string(o.ngl == 0 ? "none (CPU only)" : "all") << "},\n"
        << "  \"build\": {\"library\": " << json_string(library_path())
        << ", \"system_info\": " << json_string(llama_print_system_info()) << ", \"backend_devices\": " << devices
        << ", \"compiler\": " << json_string(__VERSION__) << "}\n"
        << "}\n";
    if (!out) {
        fail("cannot write " + o.out + ".json");
    }
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    const Options o = parse(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    const bool cpu_only = o.ngl == 0;
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = o.ngl;
    // Weights on the CPU stay as the file has them: no repacking into the CPU backend's extra
    // buffer types, whose AMX matmul faults where the CPU lists AMX but the kernel has not enabled
    // it, and whose other layouts change the CPU kernels' summation order from one machine to the next.
    mparams.use_extra_bufts = false;
    mparams.progress_callback = [](float, void *) { return true; };  // no loading dots on stderr
    ggml_backend_dev_t no_devices[] = {nullptr};
    if (cpu_only) {
        mparams.devices = no_devices;  // an empty list: the model is given no GPU at all
    }
    llama_model * model = llama_model_load_from_file(o.model.c_str(), mparams);
    if (model == nullptr) {
        fail(o.model + ": llama.cpp cannot load it");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> fed = read_tokens(o.tokens, o.n_prompt, n_vocab);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = static_cast<uint32_t>(o.ctx);
    cparams.n_batch = static_cast<uint32_t>(o.ubatch);
    cparams.n_ubatch = static_cast<uint32_t>(o.ubatch);
    cparams.n_threads = o.threads;
    cparams.n_threads_batch = o.threads;
    cparams.no_perf = true;
    cparams.flash_attn_type = o.fa == "on"    ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                              : o.fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                              : LLAMA_FLASH_ATTN_TYPE_AUTO;
    if (cpu_only) {
        cparams.offload_kqv = false;
        cparams.op_offload = false;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fail(o.model + ": cannot create a context of " + std::to_string(o.ctx) + " tokens");
    }

    std::vector<float> rows;
    rows.reserve(static_cast<size_t>(o.n_prompt + o.n_gen) * n_vocab);
    llama_batch batch = llama_batch_init(o.ubatch, 0, 1);
    for (int first = 0; first < o.n_prompt; first += o.ubatch) {
        decode(ctx, batch, fed, first, std::min(o.ubatch, o.n_prompt - first), n_vocab, rows);
    }
    for (int step = 0; step < o.n_gen; ++step) {
        fed.push_back(argmax(rows.data() + rows.size() - n_vocab, n_vocab));
        decode(ctx, batch, fed, o.n_prompt + step, 1, n_vocab, rows);
    }
    llama_batch_free(batch);

    std::FILE * logits_file = std::fopen((o.out + ".logits").c_str(), "wb");
    if (logits_file == nullptr || std::fwrite(rows.data(), sizeof(float), rows.size(), logits_file) != rows.size() ||
        std::fclose(logits_file) != 0) {
        fail("cannot write " + o.out + ".logits");
    }
    std::ofstream tokens_out(o.out + ".tokens");
    for (const llama_token id : fed) {
        tokens_out << id << "\n";
    }
    if (!tokens_out) {
        fail("cannot write " + o.out + ".tokens");
    }
    write_json(o, model, ctx, n_vocab, fed, cparams.op_offload);
    std::printf("%s.logits: %zu rows of %d logits (%d prompt, %d generated)\n", o.out.c_str(), fed.size(), n_vocab,
                o.n_prompt, o.n_gen);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

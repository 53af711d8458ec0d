// Decode N random single tokens (seed 1) with llama.cpp's CPU build and write, for every step and
// layer, the graph tensors predict.py reads: F32 "ffn_inp-L" (the hidden state after attention),
// "attn_norm-L", "ffn_norm-L", and I32 "ffn_moe_topk-L" (the experts chosen), each as a record of
// a 64-byte name, an int32 (1: int32 values), an int32 count and the values.
//
// usage: dump_hidden MODEL.gguf STEPS OUT.bin
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
static FILE * out;
static bool want(const char * n) {
    return !strncmp(n, "ffn_inp-", 8) || !strncmp(n, "ffn_moe_topk-", 13) || !strncmp(n, "attn_norm-", 10) || !strncmp(n, "ffn_norm-", 9);
}
static bool cb(ggml_tensor * t, bool ask, void *) {
    if (!want(t->name)) return false;
    if (ask) return true;
    int64_t n = t->ne[0];
    int type = t->type == GGML_TYPE_I32 ? 1 : 0;
    if (t->type != GGML_TYPE_I32 && t->type != GGML_TYPE_F32) return true;
    char name[64] = {0};
    strncpy(name, t->name, 63);
    fwrite(name, 1, 64, out);
    fwrite(&type, 4, 1, out);
    int32_t nn = (int32_t)n;
    fwrite(&nn, 4, 1, out);
    std::vector<char> buf(n * 4);
    ggml_backend_tensor_get(t, buf.data(), 0, n * 4);
    fwrite(buf.data(), 1, n * 4, out);
    return true;
}
int main(int argc, char ** argv) {
    const char * path = argv[1];
    int steps = atoi(argv[2]);
    out = fopen(argv[3], "wb");
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(path, mp);
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 16; cp.n_ubatch = 16; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr; cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::mt19937 rng(1);
    std::uniform_int_distribution<int> tok(0, nv - 1);
    llama_batch b = llama_batch_init(1, 0, 1);
    for (int s = 0; s < steps; ++s) {
        b.n_tokens = 1; b.token[0] = tok(rng); b.pos[0] = s; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0; b.logits[0] = 1;
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
        fprintf(stderr, "step %d\n", s);
    }
    fclose(out);
    return 0;
}

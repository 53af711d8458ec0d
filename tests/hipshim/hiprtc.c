/*
 * hipRTC over NVRTC. A hipRTC program wraps an NVRTC program plus a note the shim adds to the
 * compile log (an option it could not translate), so the caller reads one log either way.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nvrtc.h>

#define HIPSHIM_API __attribute__((visibility("default")))

typedef int hiprtcResult;
enum {
    HIPRTC_SUCCESS = 0,
    HIPRTC_ERROR_OUT_OF_MEMORY = 1,
    HIPRTC_ERROR_INVALID_INPUT = 3,
    HIPRTC_ERROR_INVALID_PROGRAM = 4,
    HIPRTC_ERROR_INVALID_OPTION = 5,
    HIPRTC_ERROR_INTERNAL_ERROR = 11,
    HIPRTC_ERROR_LINKING = 100,
};

struct shim_program {
    nvrtcProgram nvrtc;
    char note[256]; /* empty unless the shim rejected an option */
    int has_cubin;  /* compiled for a real sm_XX: GetCode hands out CUBIN, else PTX */
};
typedef struct shim_program *hiprtcProgram;

HIPSHIM_API const char *hiprtcGetErrorString(hiprtcResult result);
HIPSHIM_API hiprtcResult hiprtcVersion(int *major, int *minor);
HIPSHIM_API hiprtcResult hiprtcCreateProgram(hiprtcProgram *prog, const char *src, const char *name,
                                             int numHeaders, const char *const *headers,
                                             const char *const *includeNames);
HIPSHIM_API hiprtcResult hiprtcCompileProgram(hiprtcProgram prog, int numOptions, const char *const *options);
HIPSHIM_API hiprtcResult hiprtcGetCodeSize(hiprtcProgram prog, size_t *codeSizeRet);
HIPSHIM_API hiprtcResult hiprtcGetCode(hiprtcProgram prog, char *code);
HIPSHIM_API hiprtcResult hiprtcGetProgramLogSize(hiprtcProgram prog, size_t *logSizeRet);
HIPSHIM_API hiprtcResult hiprtcGetProgramLog(hiprtcProgram prog, char *log);
HIPSHIM_API hiprtcResult hiprtcDestroyProgram(hiprtcProgram *prog);

/* NVRTC's codes 0..11 mean what hipRTC's do; its newer ones (12..18: PCH, cancellation, time
 * trace) have no hipRTC twin. */
static hiprtcResult from_nvrtc(nvrtcResult status)
{
    return (int)status <= HIPRTC_ERROR_INTERNAL_ERROR ? (hiprtcResult)status : HIPRTC_ERROR_INTERNAL_ERROR;
}

HIPSHIM_API const char *hiprtcGetErrorString(hiprtcResult result)
{
    if (result >= HIPRTC_SUCCESS && result <= HIPRTC_ERROR_INTERNAL_ERROR) {
        return nvrtcGetErrorString((nvrtcResult)result);
    }
    return result == HIPRTC_ERROR_LINKING ? "HIPRTC_ERROR_LINKING" : "unknown hiprtc error";
}

/* NVRTC's own version (e.g. 13.0): callers only log it. */
HIPSHIM_API hiprtcResult hiprtcVersion(int *major, int *minor)
{
    return from_nvrtc(nvrtcVersion(major, minor));
}

HIPSHIM_API hiprtcResult hiprtcCreateProgram(hiprtcProgram *prog, const char *src, const char *name,
                                             int numHeaders, const char *const *headers,
                                             const char *const *includeNames)
{
    if (!prog) {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    struct shim_program *p = calloc(1, sizeof *p);
    if (!p) {
        return HIPRTC_ERROR_OUT_OF_MEMORY;
    }
    nvrtcResult status = nvrtcCreateProgram(&p->nvrtc, src, name, numHeaders, headers, includeNames);
    if (status != NVRTC_SUCCESS) {
        free(p);
        return from_nvrtc(status);
    }
    *prog = p;
    return HIPRTC_SUCCESS;
}

/* The value of an --offload-arch / --gpu-architecture option, or NULL for other options. */
static const char *arch_value(const char *option)
{
    static const char *const prefixes[] = {"--offload-arch=", "-offload-arch=", "--gpu-architecture=",
                                           "-arch="};
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; ++i) {
        size_t n = strlen(prefixes[i]);
        if (strncmp(option, prefixes[i], n) == 0) {
            return option + n;
        }
    }
    return NULL;
}

/* "sm_90" or "sm_90:feature..." (the target-id shape hipRTC uses) -> "--gpu-architecture=sm_90".
 * AMD targets cannot be compiled here; that is a caller bug worth a clear log line. */
static int translate_arch(struct shim_program *p, const char *value, char *out, size_t size)
{
    size_t len = strcspn(value, ":");
    if (strncmp(value, "sm_", 3) != 0 && strncmp(value, "compute_", 8) != 0) {
        snprintf(p->note, sizeof p->note,
                 "hipshim: cannot compile for '%.*s' on NVIDIA; pass the device's gcnArchName (sm_XX)\n",
                 (int)len, value);
        return 0;
    }
    snprintf(out, size, "--gpu-architecture=%.*s", (int)len, value);
    return 1;
}

/* Without a target, hipRTC compiles for the current device; so does the shim. */
static int current_device_arch(char *out, size_t size)
{
    int device = 0;
    int major = 0;
    int minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        return 0;
    }
    snprintf(out, size, "--gpu-architecture=sm_%d%d", major, minor);
    return 1;
}

static hiprtcResult compile_with(struct shim_program *p, int count, const char **options)
{
    size_t cubin_size = 0;
    nvrtcResult status = nvrtcCompileProgram(p->nvrtc, count, options);
    if (status != NVRTC_SUCCESS) {
        return from_nvrtc(status);
    }
    p->has_cubin = nvrtcGetCUBINSize(p->nvrtc, &cubin_size) == NVRTC_SUCCESS && cubin_size > 0;
    return HIPRTC_SUCCESS;
}

HIPSHIM_API hiprtcResult hiprtcCompileProgram(hiprtcProgram prog, int numOptions, const char *const *options)
{
    if (!prog || numOptions < 0 || (numOptions > 0 && !options)) {
        return prog ? HIPRTC_ERROR_INVALID_INPUT : HIPRTC_ERROR_INVALID_PROGRAM;
    }
    const char **translated = calloc((size_t)numOptions + 1, sizeof *translated);
    char arch[64] = "";
    int has_arch = 0;
    hiprtcResult result = HIPRTC_SUCCESS;
    if (!translated) {
        return HIPRTC_ERROR_OUT_OF_MEMORY;
    }
    prog->note[0] = '\0';
    for (int i = 0; i < numOptions && result == HIPRTC_SUCCESS; ++i) {
        const char *value = arch_value(options[i]);
        translated[i] = options[i];
        if (value) {
            has_arch = 1;
            if (!translate_arch(prog, value, arch, sizeof arch)) {
                result = HIPRTC_ERROR_INVALID_OPTION;
            }
            translated[i] = arch;
        }
    }
    int count = numOptions;
    if (result == HIPRTC_SUCCESS && !has_arch) {
        if (current_device_arch(arch, sizeof arch)) {
            translated[count++] = arch;
        }
    }
    if (result == HIPRTC_SUCCESS) {
        result = compile_with(prog, count, translated);
    }
    free(translated);
    return result;
}

HIPSHIM_API hiprtcResult hiprtcGetCodeSize(hiprtcProgram prog, size_t *codeSizeRet)
{
    if (!prog) {
        return HIPRTC_ERROR_INVALID_PROGRAM;
    }
    if (prog->has_cubin) {
        return from_nvrtc(nvrtcGetCUBINSize(prog->nvrtc, codeSizeRet));
    }
    return from_nvrtc(nvrtcGetPTXSize(prog->nvrtc, codeSizeRet));
}

HIPSHIM_API hiprtcResult hiprtcGetCode(hiprtcProgram prog, char *code)
{
    if (!prog) {
        return HIPRTC_ERROR_INVALID_PROGRAM;
    }
    if (prog->has_cubin) {
        return from_nvrtc(nvrtcGetCUBIN(prog->nvrtc, code));
    }
    return from_nvrtc(nvrtcGetPTX(prog->nvrtc, code));
}

/* The log is the shim's note (if any) followed by NVRTC's log, NUL-terminated. */
HIPSHIM_API hiprtcResult hiprtcGetProgramLogSize(hiprtcProgram prog, size_t *logSizeRet)
{
    size_t nvrtc_size = 0;
    if (!prog || !logSizeRet) {
        return prog ? HIPRTC_ERROR_INVALID_INPUT : HIPRTC_ERROR_INVALID_PROGRAM;
    }
    nvrtcResult status = nvrtcGetProgramLogSize(prog->nvrtc, &nvrtc_size);
    if (status != NVRTC_SUCCESS) {
        return from_nvrtc(status);
    }
    *logSizeRet = strlen(prog->note) + (nvrtc_size ? nvrtc_size : 1);
    return HIPRTC_SUCCESS;
}

HIPSHIM_API hiprtcResult hiprtcGetProgramLog(hiprtcProgram prog, char *log)
{
    size_t note_len;
    if (!prog || !log) {
        return prog ? HIPRTC_ERROR_INVALID_INPUT : HIPRTC_ERROR_INVALID_PROGRAM;
    }
    note_len = strlen(prog->note);
    memcpy(log, prog->note, note_len);
    log[note_len] = '\0';
    return from_nvrtc(nvrtcGetProgramLog(prog->nvrtc, log + note_len));
}

HIPSHIM_API hiprtcResult hiprtcDestroyProgram(hiprtcProgram *prog)
{
    if (!prog || !*prog) {
        return HIPRTC_ERROR_INVALID_PROGRAM;
    }
    nvrtcResult status = nvrtcDestroyProgram(&(*prog)->nvrtc);
    free(*prog);
    *prog = NULL;
    return from_nvrtc(status);
}

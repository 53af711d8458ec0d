/* Code objects and launches through the driver API (hipModule_t == CUmodule). */
#include "shim.h"

/* BUFFER_POINTER, its value, BUFFER_SIZE, its value, END: hip-python never sends more. */
#define MAX_EXTRA_ENTRIES 9

HIPSHIM_API hipError_t hipModuleLoadData(hipModule_t *module, const void *image)
{
    hipError_t status = hipshim_bind_context();
    if (status != hipSuccess) {
        return status;
    }
    return hipshim_from_cu(cuModuleLoadData((CUmodule *)module, image));
}

HIPSHIM_API hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *kname)
{
    return hipshim_from_cu(cuModuleGetFunction((CUfunction *)function, (CUmodule)module, kname));
}

HIPSHIM_API hipError_t hipModuleUnload(hipModule_t module)
{
    return hipshim_from_cu(cuModuleUnload((CUmodule)module));
}

/* Copy HIP's `extra` into CUDA's spelling: the keys BUFFER_POINTER and BUFFER_SIZE have the
 * same values, but HIP ends the list with 3 where CUDA ends it with 0 (NULL). */
static int translate_extra(void **extra, void **out)
{
    for (int i = 0; i + 1 < MAX_EXTRA_ENTRIES; i += 2) {
        if (extra[i] == HIP_LAUNCH_PARAM_END) {
            out[i] = CU_LAUNCH_PARAM_END;
            return 1;
        }
        if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_POINTER) {
            out[i] = CU_LAUNCH_PARAM_BUFFER_POINTER;
        } else if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_SIZE) {
            out[i] = CU_LAUNCH_PARAM_BUFFER_SIZE;
        } else {
            return 0;
        }
        out[i + 1] = extra[i + 1];
    }
    return 0;
}

HIPSHIM_API hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY,
                                             unsigned int gridDimZ, unsigned int blockDimX,
                                             unsigned int blockDimY, unsigned int blockDimZ,
                                             unsigned int sharedMemBytes, hipStream_t stream,
                                             void **kernelParams, void **extra)
{
    void *cuda_extra[MAX_EXTRA_ENTRIES];
    if (extra && !translate_extra(extra, cuda_extra)) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    hipError_t status = hipshim_bind_context();
    if (status != hipSuccess) {
        return status;
    }
    return hipshim_from_cu(cuLaunchKernel((CUfunction)f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
                                          blockDimZ, sharedMemBytes, (CUstream)stream, kernelParams,
                                          extra ? cuda_extra : NULL));
}

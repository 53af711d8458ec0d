/* Error codes: CUDA status -> hipError_t, names and strings, the per-thread last error. */
#include <stddef.h>

#include "shim.h"

struct error_name {
    int code;
    const char *name;
};

/* Codes whose number and meaning are the same in HIP and in CUDA (runtime or driver API). A
 * CUDA code outside this table has no HIP twin and becomes hipErrorUnknown, because hip-python
 * raises ValueError on a number that is not a hipError_t member. */
static const struct error_name shared_codes[] = {
    {0, "hipSuccess"},
    {1, "hipErrorInvalidValue"},
    {2, "hipErrorOutOfMemory"},
    {3, "hipErrorNotInitialized"},
    {4, "hipErrorDeinitialized"},
    {5, "hipErrorProfilerDisabled"},
    {6, "hipErrorProfilerNotInitialized"},
    {7, "hipErrorProfilerAlreadyStarted"},
    {8, "hipErrorProfilerAlreadyStopped"},
    {9, "hipErrorInvalidConfiguration"},
    {12, "hipErrorInvalidPitchValue"},
    {13, "hipErrorInvalidSymbol"},
    {17, "hipErrorInvalidDevicePointer"},
    {21, "hipErrorInvalidMemcpyDirection"},
    {35, "hipErrorInsufficientDriver"},
    {52, "hipErrorMissingConfiguration"},
    {53, "hipErrorPriorLaunchFailure"},
    {98, "hipErrorInvalidDeviceFunction"},
    {100, "hipErrorNoDevice"},
    {101, "hipErrorInvalidDevice"},
    {200, "hipErrorInvalidImage"},
    {201, "hipErrorInvalidContext"},
    {202, "hipErrorContextAlreadyCurrent"},
    {205, "hipErrorMapFailed"},
    {206, "hipErrorUnmapFailed"},
    {207, "hipErrorArrayIsMapped"},
    {208, "hipErrorAlreadyMapped"},
    {209, "hipErrorNoBinaryForGpu"},
    {210, "hipErrorAlreadyAcquired"},
    {211, "hipErrorNotMapped"},
    {212, "hipErrorNotMappedAsArray"},
    {213, "hipErrorNotMappedAsPointer"},
    {214, "hipErrorECCNotCorrectable"},
    {215, "hipErrorUnsupportedLimit"},
    {217, "hipErrorPeerAccessUnsupported"},
    {218, "hipErrorInvalidKernelFile"},
    {219, "hipErrorInvalidGraphicsContext"},
    {300, "hipErrorInvalidSource"},
    {301, "hipErrorFileNotFound"},
    {302, "hipErrorSharedObjectSymbolNotFound"},
    {303, "hipErrorSharedObjectInitFailed"},
    {304, "hipErrorOperatingSystem"},
    {400, "hipErrorInvalidHandle"},
    {401, "hipErrorIllegalState"},
    {500, "hipErrorNotFound"},
    {600, "hipErrorNotReady"},
    {700, "hipErrorIllegalAddress"},
    {701, "hipErrorLaunchOutOfResources"},
    {702, "hipErrorLaunchTimeOut"},
    {704, "hipErrorPeerAccessAlreadyEnabled"},
    {705, "hipErrorPeerAccessNotEnabled"},
    {708, "hipErrorSetOnActiveProcess"},
    {709, "hipErrorContextIsDestroyed"},
    {710, "hipErrorAssert"},
    {712, "hipErrorHostMemoryAlreadyRegistered"},
    {713, "hipErrorHostMemoryNotRegistered"},
    {719, "hipErrorLaunchFailure"},
    {720, "hipErrorCooperativeLaunchTooLarge"},
    {801, "hipErrorNotSupported"},
    {900, "hipErrorStreamCaptureUnsupported"},
    {901, "hipErrorStreamCaptureInvalidated"},
    {902, "hipErrorStreamCaptureMerge"},
    {903, "hipErrorStreamCaptureUnmatched"},
    {904, "hipErrorStreamCaptureUnjoined"},
    {905, "hipErrorStreamCaptureIsolation"},
    {906, "hipErrorStreamCaptureImplicit"},
    {907, "hipErrorCapturedEvent"},
    {908, "hipErrorStreamCaptureWrongThread"},
    {910, "hipErrorGraphExecUpdateFailure"},
    {914, "hipErrorInvalidResourceType"},
    {915, "hipErrorInvalidResourceConfiguration"},
    {999, "hipErrorUnknown"},
};

static _Thread_local hipError_t last_error = hipSuccess;

static const char *shared_name(int code)
{
    for (size_t i = 0; i < sizeof shared_codes / sizeof shared_codes[0]; ++i) {
        if (shared_codes[i].code == code) {
            return shared_codes[i].name;
        }
    }
    return NULL;
}

hipError_t hipshim_fail(hipError_t status)
{
    /* NotReady answers a query; like CUDA, HIP does not keep it as the thread's error. */
    if (status != hipSuccess && status != hipErrorNotReady) {
        last_error = status;
    }
    return status;
}

hipError_t hipshim_from_cuda(cudaError_t status)
{
    return hipshim_fail(shared_name((int)status) ? (hipError_t)status : hipErrorUnknown);
}

hipError_t hipshim_from_cu(CUresult status)
{
    return hipshim_fail(shared_name((int)status) ? (hipError_t)status : hipErrorUnknown);
}

HIPSHIM_API const char *hipGetErrorName(hipError_t hip_error)
{
    const char *name = shared_name(hip_error);
    return name ? name : "hipErrorUnknown";
}

HIPSHIM_API const char *hipGetErrorString(hipError_t hipError)
{
    const char *text = NULL;
    if (!shared_name(hipError)) {
        return "unknown error";
    }
    /* Shared codes mean the same in both APIs, so CUDA's wording describes the HIP code; the
     * driver knows the codes above 200, the runtime the low ones it alone defines. */
    if (cuGetErrorString((CUresult)hipError, &text) == CUDA_SUCCESS && text) {
        return text;
    }
    return cudaGetErrorString((cudaError_t)hipError);
}

HIPSHIM_API hipError_t hipGetLastError(void)
{
    hipError_t status = last_error;
    last_error = hipSuccess;
    (void)cudaGetLastError(); /* reset the runtime's copy too, so it cannot resurface later */
    return status;
}

HIPSHIM_API hipError_t hipPeekAtLastError(void)
{
    return last_error;
}

hipError_t hipshim_bind_context(void)
{
    CUcontext current = NULL;
    int device = 0;
    CUresult status = cuCtxGetCurrent(&current);
    if (status == CUDA_ERROR_NOT_INITIALIZED) {
        status = cuInit(0);
        if (status == CUDA_SUCCESS) {
            status = cuCtxGetCurrent(&current);
        }
    }
    if (status != CUDA_SUCCESS) {
        return hipshim_from_cu(status);
    }
    if (current) {
        return hipSuccess;
    }
    cudaError_t rt = cudaGetDevice(&device);
    if (rt == cudaSuccess) {
        rt = cudaSetDevice(device); /* makes the device's primary context current */
    }
    return hipshim_from_cuda(rt);
}

/* Streams and events: handles are CUDA's own (hipStream_t == cudaStream_t == CUstream). */
#include "shim.h"

HIPSHIM_API hipError_t hipStreamCreate(hipStream_t *stream)
{
    return hipshim_from_cuda(cudaStreamCreate((cudaStream_t *)stream));
}

HIPSHIM_API hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags)
{
    return hipshim_from_cuda(
        cudaStreamCreateWithFlags((cudaStream_t *)stream, flags & HIPSHIM_STREAM_CUDA_BITS));
}

HIPSHIM_API hipError_t hipStreamDestroy(hipStream_t stream)
{
    return hipshim_from_cuda(cudaStreamDestroy((cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipStreamSynchronize(hipStream_t stream)
{
    return hipshim_from_cuda(cudaStreamSynchronize((cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipStreamQuery(hipStream_t stream)
{
    return hipshim_from_cuda(cudaStreamQuery((cudaStream_t)stream));
}

/* HIP defines no wait flags (callers pass 0); CUDA's only one, External, is not HIP's to set. */
HIPSHIM_API hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned int flags)
{
    if (flags != 0) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    return hipshim_from_cuda(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0));
}

/* Stream capture and graphs: HIP's capture modes have CUDA's numbers (global 0, thread-local 1,
 * relaxed 2), and graph handles are CUDA's own. */
HIPSHIM_API hipError_t hipStreamBeginCapture(hipStream_t stream, int mode)
{
    if (mode < 0 || mode > 2) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    return hipshim_from_cuda(cudaStreamBeginCapture((cudaStream_t)stream, (enum cudaStreamCaptureMode)mode));
}

HIPSHIM_API hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t *graph)
{
    return hipshim_from_cuda(cudaStreamEndCapture((cudaStream_t)stream, (cudaGraph_t *)graph));
}

HIPSHIM_API hipError_t hipGraphInstantiateWithFlags(hipGraphExec_t *exec, hipGraph_t graph, unsigned long long flags)
{
    return hipshim_from_cuda(cudaGraphInstantiateWithFlags((cudaGraphExec_t *)exec, (cudaGraph_t)graph, flags));
}

HIPSHIM_API hipError_t hipGraphLaunch(hipGraphExec_t exec, hipStream_t stream)
{
    return hipshim_from_cuda(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipGraphExecDestroy(hipGraphExec_t exec)
{
    return hipshim_from_cuda(cudaGraphExecDestroy((cudaGraphExec_t)exec));
}

HIPSHIM_API hipError_t hipGraphDestroy(hipGraph_t graph)
{
    return hipshim_from_cuda(cudaGraphDestroy((cudaGraph_t)graph));
}

HIPSHIM_API hipError_t hipEventCreate(hipEvent_t *event)
{
    return hipshim_from_cuda(cudaEventCreate((cudaEvent_t *)event));
}

/* The release-scope and system-fence bits in HIP's high bits have no CUDA meaning. */
HIPSHIM_API hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned int flags)
{
    return hipshim_from_cuda(cudaEventCreateWithFlags((cudaEvent_t *)event, flags & HIPSHIM_EVENT_CUDA_BITS));
}

HIPSHIM_API hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream)
{
    return hipshim_from_cuda(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipEventQuery(hipEvent_t event)
{
    return hipshim_from_cuda(cudaEventQuery((cudaEvent_t)event));
}

HIPSHIM_API hipError_t hipEventSynchronize(hipEvent_t event)
{
    return hipshim_from_cuda(cudaEventSynchronize((cudaEvent_t)event));
}

HIPSHIM_API hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop)
{
    return hipshim_from_cuda(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)stop));
}

HIPSHIM_API hipError_t hipEventDestroy(hipEvent_t event)
{
    return hipshim_from_cuda(cudaEventDestroy((cudaEvent_t)event));
}

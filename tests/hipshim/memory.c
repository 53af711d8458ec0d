/* Memory: device and pinned allocations, copies, memsets, host registration, pointer queries. */
#include "shim.h"

/* hipMemcpyKind shares CUDA's numbers 0..4; DeviceToDeviceNoCU (an AMD copy-engine hint) is a
 * plain device-to-device copy here. */
static int to_cuda_kind(hipMemcpyKind kind, enum cudaMemcpyKind *out)
{
    if (kind >= cudaMemcpyHostToHost && kind <= cudaMemcpyDefault) {
        *out = (enum cudaMemcpyKind)kind;
        return 1;
    }
    if (kind == hipMemcpyDeviceToDeviceNoCU) {
        *out = cudaMemcpyDeviceToDevice;
        return 1;
    }
    return 0;
}

HIPSHIM_API hipError_t hipMalloc(void **ptr, size_t size)
{
    return hipshim_from_cuda(cudaMalloc(ptr, size));
}

HIPSHIM_API hipError_t hipFree(void *ptr)
{
    return hipshim_from_cuda(cudaFree(ptr));
}

HIPSHIM_API hipError_t hipMemcpy(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind)
{
    enum cudaMemcpyKind cuda_kind;
    if (!to_cuda_kind(kind, &cuda_kind)) {
        return hipshim_fail(hipErrorInvalidMemcpyDirection);
    }
    return hipshim_from_cuda(cudaMemcpy(dst, src, sizeBytes, cuda_kind));
}

HIPSHIM_API hipError_t hipMemcpyAsync(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind,
                                      hipStream_t stream)
{
    enum cudaMemcpyKind cuda_kind;
    if (!to_cuda_kind(kind, &cuda_kind)) {
        return hipshim_fail(hipErrorInvalidMemcpyDirection);
    }
    return hipshim_from_cuda(cudaMemcpyAsync(dst, src, sizeBytes, cuda_kind, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipMemcpyPeer(void *dst, int dstDeviceId, const void *src, int srcDeviceId,
                                     size_t sizeBytes)
{
    return hipshim_from_cuda(cudaMemcpyPeer(dst, dstDeviceId, src, srcDeviceId, sizeBytes));
}

HIPSHIM_API hipError_t hipMemcpyPeerAsync(void *dst, int dstDeviceId, const void *src, int srcDevice,
                                          size_t sizeBytes, hipStream_t stream)
{
    return hipshim_from_cuda(
        cudaMemcpyPeerAsync(dst, dstDeviceId, src, srcDevice, sizeBytes, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipMemset(void *dst, int value, size_t sizeBytes)
{
    return hipshim_from_cuda(cudaMemset(dst, value, sizeBytes));
}

HIPSHIM_API hipError_t hipMemsetAsync(void *dst, int value, size_t sizeBytes, hipStream_t stream)
{
    return hipshim_from_cuda(cudaMemsetAsync(dst, value, sizeBytes, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipMemsetD8Async(void *dest, unsigned char value, size_t count, hipStream_t stream)
{
    return hipshim_from_cuda(cudaMemsetAsync(dest, value, count, (cudaStream_t)stream));
}

HIPSHIM_API hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags)
{
    return hipshim_from_cuda(cudaHostAlloc(ptr, size, flags & HIPSHIM_HOST_MALLOC_CUDA_BITS));
}

HIPSHIM_API hipError_t hipHostFree(void *ptr)
{
    return hipshim_from_cuda(cudaFreeHost(ptr));
}

/* Bit 8 is hipHostRegisterReadOnly (HIP's headers give the same bit a second name,
 * hipExtHostRegisterCoarseGrained, which AMD devices read when they ignore read-only); HIP on
 * NVIDIA maps it to cudaHostRegisterReadOnly, and so does the shim. */
HIPSHIM_API hipError_t hipHostRegister(void *hostPtr, size_t sizeBytes, unsigned int flags)
{
    return hipshim_from_cuda(cudaHostRegister(hostPtr, sizeBytes, flags & HIPSHIM_HOST_REGISTER_CUDA_BITS));
}

HIPSHIM_API hipError_t hipHostUnregister(void *hostPtr)
{
    return hipshim_from_cuda(cudaHostUnregister(hostPtr));
}

HIPSHIM_API hipError_t hipHostGetDevicePointer(void **devPtr, void *hstPtr, unsigned int flags)
{
    return hipshim_from_cuda(cudaHostGetDevicePointer(devPtr, hstPtr, flags));
}

/* CUDA answers an unregistered host pointer with type Unregistered and success; that is kept
 * (recent HIP does the same). */
HIPSHIM_API hipError_t hipPointerGetAttributes(hipPointerAttribute_t *attributes, const void *ptr)
{
    struct cudaPointerAttributes a;
    if (!attributes) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    cudaError_t status = cudaPointerGetAttributes(&a, ptr);
    if (status != cudaSuccess) {
        return hipshim_from_cuda(status);
    }
    attributes->type = (hipMemoryType)a.type; /* Unregistered/Host/Device/Managed share 0..3 */
    attributes->device = a.device;
    attributes->devicePointer = a.devicePointer;
    attributes->hostPointer = a.hostPointer;
    attributes->isManaged = a.type == cudaMemoryTypeManaged;
    attributes->allocationFlags = 0; /* CUDA does not report them for registered memory */
    return hipSuccess;
}

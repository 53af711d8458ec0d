/* Devices: enumeration, versions, properties, attributes, peer access, synchronization. */
#include <stdio.h>
#include <string.h>

#include "shim.h"

HIPSHIM_API hipError_t hipInit(unsigned int flags)
{
    return hipshim_from_cu(cuInit(flags));
}

/* Versions are CUDA's own numbers (e.g. 13000): callers only test them for being positive. */
HIPSHIM_API hipError_t hipDriverGetVersion(int *driverVersion)
{
    return hipshim_from_cuda(cudaDriverGetVersion(driverVersion));
}

HIPSHIM_API hipError_t hipRuntimeGetVersion(int *runtimeVersion)
{
    return hipshim_from_cuda(cudaRuntimeGetVersion(runtimeVersion));
}

HIPSHIM_API hipError_t hipGetDeviceCount(int *count)
{
    return hipshim_from_cuda(cudaGetDeviceCount(count));
}

HIPSHIM_API hipError_t hipGetDevice(int *deviceId)
{
    return hipshim_from_cuda(cudaGetDevice(deviceId));
}

HIPSHIM_API hipError_t hipSetDevice(int deviceId)
{
    return hipshim_from_cuda(cudaSetDevice(deviceId));
}

static hipError_t check_device(int device)
{
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        return hipshim_from_cuda(status);
    }
    return device >= 0 && device < count ? hipSuccess : hipshim_fail(hipErrorInvalidDevice);
}

HIPSHIM_API hipError_t hipDeviceGet(hipDevice_t *device, int ordinal)
{
    if (!device) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    hipError_t status = check_device(ordinal);
    if (status == hipSuccess) {
        *device = ordinal; /* HIP device handles are the ordinals */
    }
    return status;
}

/* The driver API answers these two directly once it is initialized (cuInit is idempotent). */
HIPSHIM_API hipError_t hipDeviceGetName(char *name, int len, hipDevice_t device)
{
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) {
        status = cuDeviceGetName(name, len, (CUdevice)device);
    }
    return hipshim_from_cu(status);
}

HIPSHIM_API hipError_t hipDeviceComputeCapability(int *major, int *minor, hipDevice_t device)
{
    cudaError_t status = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
    if (status == cudaSuccess) {
        status = cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device);
    }
    return hipshim_from_cuda(status);
}

HIPSHIM_API hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t device)
{
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) {
        status = cuDeviceTotalMem(bytes, (CUdevice)device);
    }
    return hipshim_from_cu(status);
}

/* Attributes that CUDA 13 dropped from cudaDeviceProp but still answers one by one. */
static int attribute_or_zero(enum cudaDeviceAttr attr, int device)
{
    int value = 0;
    if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
        value = 0;
    }
    return value;
}

static void copy_limits(hipDeviceProp_tR0600 *p, const struct cudaDeviceProp *c)
{
    memcpy(p->maxThreadsDim, c->maxThreadsDim, sizeof p->maxThreadsDim);
    memcpy(p->maxGridSize, c->maxGridSize, sizeof p->maxGridSize);
    p->maxTexture1D = c->maxTexture1D;
    p->maxTexture1DMipmap = c->maxTexture1DMipmap;
    memcpy(p->maxTexture2D, c->maxTexture2D, sizeof p->maxTexture2D);
    memcpy(p->maxTexture2DMipmap, c->maxTexture2DMipmap, sizeof p->maxTexture2DMipmap);
    memcpy(p->maxTexture2DLinear, c->maxTexture2DLinear, sizeof p->maxTexture2DLinear);
    memcpy(p->maxTexture2DGather, c->maxTexture2DGather, sizeof p->maxTexture2DGather);
    memcpy(p->maxTexture3D, c->maxTexture3D, sizeof p->maxTexture3D);
    memcpy(p->maxTexture3DAlt, c->maxTexture3DAlt, sizeof p->maxTexture3DAlt);
    p->maxTextureCubemap = c->maxTextureCubemap;
    memcpy(p->maxTexture1DLayered, c->maxTexture1DLayered, sizeof p->maxTexture1DLayered);
    memcpy(p->maxTexture2DLayered, c->maxTexture2DLayered, sizeof p->maxTexture2DLayered);
    memcpy(p->maxTextureCubemapLayered, c->maxTextureCubemapLayered, sizeof p->maxTextureCubemapLayered);
    p->maxSurface1D = c->maxSurface1D;
    memcpy(p->maxSurface2D, c->maxSurface2D, sizeof p->maxSurface2D);
    memcpy(p->maxSurface3D, c->maxSurface3D, sizeof p->maxSurface3D);
    memcpy(p->maxSurface1DLayered, c->maxSurface1DLayered, sizeof p->maxSurface1DLayered);
    memcpy(p->maxSurface2DLayered, c->maxSurface2DLayered, sizeof p->maxSurface2DLayered);
    p->maxSurfaceCubemap = c->maxSurfaceCubemap;
    memcpy(p->maxSurfaceCubemapLayered, c->maxSurfaceCubemapLayered, sizeof p->maxSurfaceCubemapLayered);
    p->surfaceAlignment = c->surfaceAlignment;
}

static void copy_memory_fields(hipDeviceProp_tR0600 *p, const struct cudaDeviceProp *c)
{
    p->totalGlobalMem = c->totalGlobalMem;
    p->sharedMemPerBlock = c->sharedMemPerBlock;
    p->regsPerBlock = c->regsPerBlock;
    p->memPitch = c->memPitch;
    p->totalConstMem = c->totalConstMem;
    p->textureAlignment = c->textureAlignment;
    p->texturePitchAlignment = c->texturePitchAlignment;
    p->memoryBusWidth = c->memoryBusWidth;
    p->l2CacheSize = c->l2CacheSize;
    p->persistingL2CacheMaxSize = c->persistingL2CacheMaxSize;
    p->sharedMemPerMultiprocessor = c->sharedMemPerMultiprocessor;
    p->maxSharedMemoryPerMultiProcessor = c->sharedMemPerMultiprocessor;
    p->regsPerMultiprocessor = c->regsPerMultiprocessor;
    p->managedMemory = c->managedMemory;
    p->pageableMemoryAccess = c->pageableMemoryAccess;
    p->concurrentManagedAccess = c->concurrentManagedAccess;
    p->canUseHostPointerForRegisteredMem = c->canUseHostPointerForRegisteredMem;
    p->sharedMemPerBlockOptin = c->sharedMemPerBlockOptin;
    p->pageableMemoryAccessUsesHostPageTables = c->pageableMemoryAccessUsesHostPageTables;
    p->directManagedMemAccessFromHost = c->directManagedMemAccessFromHost;
    p->reservedSharedMemPerBlock = c->reservedSharedMemPerBlock;
    p->hostRegisterSupported = c->hostRegisterSupported;
    p->hostRegisterReadOnlySupported = c->hostRegisterReadOnlySupported;
    p->memoryPoolsSupported = c->memoryPoolsSupported;
    p->memoryPoolSupportedHandleTypes = c->memoryPoolSupportedHandleTypes;
    p->gpuDirectRDMASupported = c->gpuDirectRDMASupported;
    p->gpuDirectRDMAFlushWritesOptions = c->gpuDirectRDMAFlushWritesOptions;
    p->gpuDirectRDMAWritesOrdering = c->gpuDirectRDMAWritesOrdering;
}

static void copy_execution_fields(hipDeviceProp_tR0600 *p, const struct cudaDeviceProp *c)
{
    p->warpSize = c->warpSize;
    p->maxThreadsPerBlock = c->maxThreadsPerBlock;
    p->major = c->major;
    p->minor = c->minor;
    p->multiProcessorCount = c->multiProcessorCount;
    p->integrated = c->integrated;
    p->canMapHostMemory = c->canMapHostMemory;
    p->concurrentKernels = c->concurrentKernels;
    p->ECCEnabled = c->ECCEnabled;
    p->pciBusID = c->pciBusID;
    p->pciDeviceID = c->pciDeviceID;
    p->pciDomainID = c->pciDomainID;
    p->tccDriver = c->tccDriver;
    p->asyncEngineCount = c->asyncEngineCount;
    p->unifiedAddressing = c->unifiedAddressing;
    p->maxThreadsPerMultiProcessor = c->maxThreadsPerMultiProcessor;
    p->streamPrioritiesSupported = c->streamPrioritiesSupported;
    p->globalL1CacheSupported = c->globalL1CacheSupported;
    p->localL1CacheSupported = c->localL1CacheSupported;
    p->isMultiGpuBoard = c->isMultiGpuBoard;
    p->multiGpuBoardGroupID = c->multiGpuBoardGroupID;
    p->hostNativeAtomicSupported = c->hostNativeAtomicSupported;
    p->computePreemptionSupported = c->computePreemptionSupported;
    p->cooperativeLaunch = c->cooperativeLaunch;
    p->maxBlocksPerMultiProcessor = c->maxBlocksPerMultiProcessor;
    p->accessPolicyMaxWindowSize = c->accessPolicyMaxWindowSize;
    p->sparseHipArraySupported = c->sparseCudaArraySupported;
    p->timelineSemaphoreInteropSupported = c->timelineSemaphoreInteropSupported;
    p->deferredMappingHipArraySupported = c->deferredMappingCudaArraySupported;
    p->ipcEventSupported = c->ipcEventSupported;
    p->clusterLaunch = c->clusterLaunch;
    p->unifiedFunctionPointers = c->unifiedFunctionPointers;
}

static void copy_attribute_fields(hipDeviceProp_tR0600 *p, int device)
{
    p->clockRate = attribute_or_zero(cudaDevAttrClockRate, device);
    p->clockInstructionRate = p->clockRate;
    p->deviceOverlap = attribute_or_zero(cudaDevAttrGpuOverlap, device);
    p->kernelExecTimeoutEnabled = attribute_or_zero(cudaDevAttrKernelExecTimeout, device);
    p->computeMode = attribute_or_zero(cudaDevAttrComputeMode, device);
    p->memoryClockRate = attribute_or_zero(cudaDevAttrMemoryClockRate, device);
    p->maxTexture1DLinear = attribute_or_zero(cudaDevAttrMaxTexture1DLinearWidth, device);
    p->singleToDoublePrecisionPerfRatio = attribute_or_zero(cudaDevAttrSingleToDoublePrecisionPerfRatio, device);
}

/* The structs differ in layout (HIP inserts fields CUDA 13 dropped, and appends its own), so
 * every field is copied by name. gcnArchName carries the compile target in hipRTC's spelling
 * for this shim: "sm_<major><minor>", which libhiprtc.so accepts as --offload-arch. */
HIPSHIM_API hipError_t hipGetDevicePropertiesR0600(hipDeviceProp_tR0600 *prop, int deviceId)
{
    struct cudaDeviceProp c;
    if (!prop) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    cudaError_t status = cudaGetDeviceProperties(&c, deviceId);
    if (status != cudaSuccess) {
        return hipshim_from_cuda(status);
    }
    memset(prop, 0, sizeof *prop);
    memcpy(prop->name, c.name, sizeof prop->name);
    memcpy(prop->uuid.bytes, c.uuid.bytes, sizeof prop->uuid.bytes);
    memcpy(prop->luid, c.luid, sizeof prop->luid);
    prop->luidDeviceNodeMask = c.luidDeviceNodeMask;
    copy_memory_fields(prop, &c);
    copy_execution_fields(prop, &c);
    copy_limits(prop, &c);
    copy_attribute_fields(prop, deviceId);
    snprintf(prop->gcnArchName, sizeof prop->gcnArchName, "sm_%d%d", c.major, c.minor);
    return hipSuccess;
}

struct attribute_map {
    hipDeviceAttribute_t hip;
    enum cudaDeviceAttr cuda;
};

static const struct attribute_map attribute_table[] = {
    {hipDeviceAttributeAsyncEngineCount, cudaDevAttrAsyncEngineCount},
    {hipDeviceAttributeCanMapHostMemory, cudaDevAttrCanMapHostMemory},
    {hipDeviceAttributeCanUseHostPointerForRegisteredMem, cudaDevAttrCanUseHostPointerForRegisteredMem},
    {hipDeviceAttributeClockRate, cudaDevAttrClockRate},
    {hipDeviceAttributeConcurrentKernels, cudaDevAttrConcurrentKernels},
    {hipDeviceAttributeConcurrentManagedAccess, cudaDevAttrConcurrentManagedAccess},
    {hipDeviceAttributeIntegrated, cudaDevAttrIntegrated},
    {hipDeviceAttributeL2CacheSize, cudaDevAttrL2CacheSize},
    {hipDeviceAttributeComputeCapabilityMajor, cudaDevAttrComputeCapabilityMajor},
    {hipDeviceAttributeManagedMemory, cudaDevAttrManagedMemory},
    {hipDeviceAttributeMaxBlockDimX, cudaDevAttrMaxBlockDimX},
    {hipDeviceAttributeMaxBlockDimY, cudaDevAttrMaxBlockDimY},
    {hipDeviceAttributeMaxBlockDimZ, cudaDevAttrMaxBlockDimZ},
    {hipDeviceAttributeMaxGridDimX, cudaDevAttrMaxGridDimX},
    {hipDeviceAttributeMaxGridDimY, cudaDevAttrMaxGridDimY},
    {hipDeviceAttributeMaxGridDimZ, cudaDevAttrMaxGridDimZ},
    {hipDeviceAttributeMaxThreadsPerBlock, cudaDevAttrMaxThreadsPerBlock},
    {hipDeviceAttributeMaxThreadsPerMultiProcessor, cudaDevAttrMaxThreadsPerMultiProcessor},
    {hipDeviceAttributeMemoryBusWidth, cudaDevAttrGlobalMemoryBusWidth},
    {hipDeviceAttributeMemoryClockRate, cudaDevAttrMemoryClockRate},
    {hipDeviceAttributeComputeCapabilityMinor, cudaDevAttrComputeCapabilityMinor},
    {hipDeviceAttributeMultiprocessorCount, cudaDevAttrMultiProcessorCount},
    {hipDeviceAttributePageableMemoryAccess, cudaDevAttrPageableMemoryAccess},
    {hipDeviceAttributePageableMemoryAccessUsesHostPageTables, cudaDevAttrPageableMemoryAccessUsesHostPageTables},
    {hipDeviceAttributePciBusId, cudaDevAttrPciBusId},
    {hipDeviceAttributePciDeviceId, cudaDevAttrPciDeviceId},
    {hipDeviceAttributePciDomainId, cudaDevAttrPciDomainId},
    {hipDeviceAttributeMaxSharedMemoryPerBlock, cudaDevAttrMaxSharedMemoryPerBlock},
    {hipDeviceAttributeSharedMemPerBlockOptin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
    {hipDeviceAttributeUnifiedAddressing, cudaDevAttrUnifiedAddressing},
    {hipDeviceAttributeWarpSize, cudaDevAttrWarpSize},
    {hipDeviceAttributeMemoryPoolsSupported, cudaDevAttrMemoryPoolsSupported},
    {hipDeviceAttributeHostRegisterSupported, cudaDevAttrHostRegisterSupported},
    {hipDeviceAttributeMaxSharedMemoryPerMultiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
};

/* Attributes outside the table (AMD-only ones among them) answer hipErrorInvalidValue, which
 * is what HIP answers for an attribute the device does not support. */
HIPSHIM_API hipError_t hipDeviceGetAttribute(int *pi, hipDeviceAttribute_t attr, int deviceId)
{
    if (!pi) {
        return hipshim_fail(hipErrorInvalidValue);
    }
    for (size_t i = 0; i < sizeof attribute_table / sizeof attribute_table[0]; ++i) {
        if (attribute_table[i].hip == attr) {
            return hipshim_from_cuda(cudaDeviceGetAttribute(pi, attribute_table[i].cuda, deviceId));
        }
    }
    return hipshim_fail(hipErrorInvalidValue);
}

HIPSHIM_API hipError_t hipDeviceSynchronize(void)
{
    return hipshim_from_cuda(cudaDeviceSynchronize());
}

HIPSHIM_API hipError_t hipDeviceCanAccessPeer(int *canAccessPeer, int deviceId, int peerDeviceId)
{
    return hipshim_from_cuda(cudaDeviceCanAccessPeer(canAccessPeer, deviceId, peerDeviceId));
}

HIPSHIM_API hipError_t hipDeviceEnablePeerAccess(int peerDeviceId, unsigned int flags)
{
    return hipshim_from_cuda(cudaDeviceEnablePeerAccess(peerDeviceId, flags));
}

HIPSHIM_API hipError_t hipDeviceDisablePeerAccess(int peerDeviceId)
{
    return hipshim_from_cuda(cudaDeviceDisablePeerAccess(peerDeviceId));
}

HIPSHIM_API hipError_t hipMemGetInfo(size_t *free, size_t *total)
{
    return hipshim_from_cuda(cudaMemGetInfo(free, total));
}

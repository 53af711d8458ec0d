/*
 * The slice of the HIP runtime ABI (HIP 7.x headers, as hip-python 10.0 binds them) that the
 * shim implements. Only types, constants and prototypes live here; the numbers and the
 * hipDeviceProp_tR0600 layout are what hip-python was compiled against, so any drift is an
 * ABI break and the static assertions below catch the layout part at build time.
 */
#ifndef HIPSHIM_HIP_ABI_H
#define HIPSHIM_HIP_ABI_H

#include <stddef.h>
#include <stdint.h>

#define HIPSHIM_API __attribute__((visibility("default")))

typedef int hipError_t; /* values are hipError_t members; see errors.c for the table */
typedef int hipDevice_t;
typedef int hipDeviceAttribute_t;
typedef int hipMemcpyKind;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct ihipGraph_t *hipGraph_t;
typedef struct hipGraphExec *hipGraphExec_t;
typedef struct ihipModule_t *hipModule_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;

/* The codes the shim returns by name; CUDA's own codes pass through errors.c's table. */
enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorInvalidMemcpyDirection = 21,
    hipErrorInvalidDevice = 101,
    hipErrorNotReady = 600,
    hipErrorUnknown = 999,
};

/* Launch configuration keys in `extra`; CUDA uses 1, 2 and 0 for the same three. */
#define HIP_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define HIP_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)
#define HIP_LAUNCH_PARAM_END ((void *)0x03)

/* Flag bits whose numbers HIP shares with CUDA; any other bit is HIP-only and is dropped. */
#define HIPSHIM_HOST_MALLOC_CUDA_BITS 0x7u  /* Portable | Mapped | WriteCombined */
#define HIPSHIM_HOST_REGISTER_CUDA_BITS 0xFu /* Portable | Mapped | IoMemory | ReadOnly */
#define HIPSHIM_EVENT_CUDA_BITS 0x7u        /* BlockingSync | DisableTiming | Interprocess */
#define HIPSHIM_STREAM_CUDA_BITS 0x1u       /* NonBlocking */
#define hipMemcpyDeviceToDeviceNoCU 1024

typedef enum {
    hipMemoryTypeUnregistered = 0,
    hipMemoryTypeHost = 1,
    hipMemoryTypeDevice = 2,
    hipMemoryTypeManaged = 3,
} hipMemoryType;

typedef struct {
    hipMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    int isManaged;
    unsigned int allocationFlags;
} hipPointerAttribute_t;

typedef struct {
    char bytes[16];
} hipUUID;

/* hipDeviceProp_tR0600, field for field. */
typedef struct {
    char name[256];
    hipUUID uuid;
    char luid[8];
    unsigned int luidDeviceNodeMask;
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    size_t memPitch;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int clockRate;
    size_t totalConstMem;
    int major;
    int minor;
    size_t textureAlignment;
    size_t texturePitchAlignment;
    int deviceOverlap;
    int multiProcessorCount;
    int kernelExecTimeoutEnabled;
    int integrated;
    int canMapHostMemory;
    int computeMode;
    int maxTexture1D;
    int maxTexture1DMipmap;
    int maxTexture1DLinear;
    int maxTexture2D[2];
    int maxTexture2DMipmap[2];
    int maxTexture2DLinear[3];
    int maxTexture2DGather[2];
    int maxTexture3D[3];
    int maxTexture3DAlt[3];
    int maxTextureCubemap;
    int maxTexture1DLayered[2];
    int maxTexture2DLayered[3];
    int maxTextureCubemapLayered[2];
    int maxSurface1D;
    int maxSurface2D[2];
    int maxSurface3D[3];
    int maxSurface1DLayered[2];
    int maxSurface2DLayered[3];
    int maxSurfaceCubemap;
    int maxSurfaceCubemapLayered[2];
    size_t surfaceAlignment;
    int concurrentKernels;
    int ECCEnabled;
    int pciBusID;
    int pciDeviceID;
    int pciDomainID;
    int tccDriver;
    int asyncEngineCount;
    int unifiedAddressing;
    int memoryClockRate;
    int memoryBusWidth;
    int l2CacheSize;
    int persistingL2CacheMaxSize;
    int maxThreadsPerMultiProcessor;
    int streamPrioritiesSupported;
    int globalL1CacheSupported;
    int localL1CacheSupported;
    size_t sharedMemPerMultiprocessor;
    int regsPerMultiprocessor;
    int managedMemory;
    int isMultiGpuBoard;
    int multiGpuBoardGroupID;
    int hostNativeAtomicSupported;
    int singleToDoublePrecisionPerfRatio;
    int pageableMemoryAccess;
    int concurrentManagedAccess;
    int computePreemptionSupported;
    int canUseHostPointerForRegisteredMem;
    int cooperativeLaunch;
    int cooperativeMultiDeviceLaunch;
    size_t sharedMemPerBlockOptin;
    int pageableMemoryAccessUsesHostPageTables;
    int directManagedMemAccessFromHost;
    int maxBlocksPerMultiProcessor;
    int accessPolicyMaxWindowSize;
    size_t reservedSharedMemPerBlock;
    int hostRegisterSupported;
    int sparseHipArraySupported;
    int hostRegisterReadOnlySupported;
    int timelineSemaphoreInteropSupported;
    int memoryPoolsSupported;
    int gpuDirectRDMASupported;
    unsigned int gpuDirectRDMAFlushWritesOptions;
    int gpuDirectRDMAWritesOrdering;
    unsigned int memoryPoolSupportedHandleTypes;
    int deferredMappingHipArraySupported;
    int ipcEventSupported;
    int clusterLaunch;
    int unifiedFunctionPointers;
    int reserved[63];
    int hipReserved[32];
    char gcnArchName[256];
    size_t maxSharedMemoryPerMultiProcessor;
    int clockInstructionRate;
    uint32_t arch; /* hipDeviceArch_t: a bitfield of AMD feature flags, left zero */
    unsigned int *hdpMemFlushCntl;
    unsigned int *hdpRegFlushCntl;
    int cooperativeMultiDeviceUnmatchedFunc;
    int cooperativeMultiDeviceUnmatchedGridDim;
    int cooperativeMultiDeviceUnmatchedBlockDim;
    int cooperativeMultiDeviceUnmatchedSharedMem;
    int isLargeBar;
    int asicRevision;
} hipDeviceProp_tR0600;

_Static_assert(sizeof(hipDeviceProp_tR0600) == 1472, "hipDeviceProp_tR0600 must be 1472 bytes");
_Static_assert(offsetof(hipDeviceProp_tR0600, totalGlobalMem) == 288, "totalGlobalMem offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, sharedMemPerBlock) == 296, "sharedMemPerBlock offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, warpSize) == 308, "warpSize offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, major) == 360, "major offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, minor) == 364, "minor offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, multiProcessorCount) == 388, "multiProcessorCount offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, canMapHostMemory) == 400, "canMapHostMemory offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, pciBusID) == 584, "pciBusID offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, unifiedAddressing) == 604, "unifiedAddressing offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, l2CacheSize) == 616, "l2CacheSize offset");
_Static_assert(offsetof(hipDeviceProp_tR0600, gcnArchName) == 1160, "gcnArchName offset");
_Static_assert(sizeof(hipPointerAttribute_t) == 32, "hipPointerAttribute_t must be 32 bytes");

/* Device attributes the shim maps (HIP's numbering, which differs from CUDA's). */
enum {
    hipDeviceAttributeAsyncEngineCount = 2,
    hipDeviceAttributeCanMapHostMemory = 3,
    hipDeviceAttributeCanUseHostPointerForRegisteredMem = 4,
    hipDeviceAttributeClockRate = 5,
    hipDeviceAttributeConcurrentKernels = 8,
    hipDeviceAttributeConcurrentManagedAccess = 9,
    hipDeviceAttributeIntegrated = 16,
    hipDeviceAttributeL2CacheSize = 19,
    hipDeviceAttributeComputeCapabilityMajor = 23,
    hipDeviceAttributeManagedMemory = 24,
    hipDeviceAttributeMaxBlockDimX = 26,
    hipDeviceAttributeMaxBlockDimY = 27,
    hipDeviceAttributeMaxBlockDimZ = 28,
    hipDeviceAttributeMaxGridDimX = 29,
    hipDeviceAttributeMaxGridDimY = 30,
    hipDeviceAttributeMaxGridDimZ = 31,
    hipDeviceAttributeMaxThreadsPerBlock = 56,
    hipDeviceAttributeMaxThreadsPerMultiProcessor = 57,
    hipDeviceAttributeMemoryBusWidth = 59,
    hipDeviceAttributeMemoryClockRate = 60,
    hipDeviceAttributeComputeCapabilityMinor = 61,
    hipDeviceAttributeMultiprocessorCount = 63,
    hipDeviceAttributePageableMemoryAccess = 65,
    hipDeviceAttributePageableMemoryAccessUsesHostPageTables = 66,
    hipDeviceAttributePciBusId = 67,
    hipDeviceAttributePciDeviceId = 68,
    hipDeviceAttributePciDomainId = 69,
    hipDeviceAttributeMaxSharedMemoryPerBlock = 74,
    hipDeviceAttributeSharedMemPerBlockOptin = 75,
    hipDeviceAttributeUnifiedAddressing = 85,
    hipDeviceAttributeWarpSize = 87,
    hipDeviceAttributeMemoryPoolsSupported = 88,
    hipDeviceAttributeHostRegisterSupported = 90,
    hipDeviceAttributeMaxSharedMemoryPerMultiprocessor = 10002,
    hipDeviceAttributeIsLargeBar = 10011,
};

/* Exported runtime functions, with the signatures hip-python declares. */
HIPSHIM_API hipError_t hipInit(unsigned int flags);
HIPSHIM_API hipError_t hipDriverGetVersion(int *driverVersion);
HIPSHIM_API hipError_t hipRuntimeGetVersion(int *runtimeVersion);
HIPSHIM_API hipError_t hipGetDeviceCount(int *count);
HIPSHIM_API hipError_t hipGetDevice(int *deviceId);
HIPSHIM_API hipError_t hipSetDevice(int deviceId);
HIPSHIM_API hipError_t hipDeviceGet(hipDevice_t *device, int ordinal);
HIPSHIM_API hipError_t hipDeviceGetName(char *name, int len, hipDevice_t device);
HIPSHIM_API hipError_t hipDeviceComputeCapability(int *major, int *minor, hipDevice_t device);
HIPSHIM_API hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t device);
HIPSHIM_API hipError_t hipGetDevicePropertiesR0600(hipDeviceProp_tR0600 *prop, int deviceId);
HIPSHIM_API hipError_t hipDeviceGetAttribute(int *pi, hipDeviceAttribute_t attr, int deviceId);
HIPSHIM_API hipError_t hipDeviceSynchronize(void);
HIPSHIM_API hipError_t hipDeviceCanAccessPeer(int *canAccessPeer, int deviceId, int peerDeviceId);
HIPSHIM_API hipError_t hipDeviceEnablePeerAccess(int peerDeviceId, unsigned int flags);
HIPSHIM_API hipError_t hipDeviceDisablePeerAccess(int peerDeviceId);
HIPSHIM_API hipError_t hipMemGetInfo(size_t *free, size_t *total);

HIPSHIM_API hipError_t hipMalloc(void **ptr, size_t size);
HIPSHIM_API hipError_t hipFree(void *ptr);
HIPSHIM_API hipError_t hipMemcpy(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind);
HIPSHIM_API hipError_t hipMemcpyAsync(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind,
                                      hipStream_t stream);
HIPSHIM_API hipError_t hipMemcpyPeer(void *dst, int dstDeviceId, const void *src, int srcDeviceId,
                                     size_t sizeBytes);
HIPSHIM_API hipError_t hipMemcpyPeerAsync(void *dst, int dstDeviceId, const void *src, int srcDevice,
                                          size_t sizeBytes, hipStream_t stream);
HIPSHIM_API hipError_t hipMemset(void *dst, int value, size_t sizeBytes);
HIPSHIM_API hipError_t hipMemsetAsync(void *dst, int value, size_t sizeBytes, hipStream_t stream);
HIPSHIM_API hipError_t hipMemsetD8Async(void *dest, unsigned char value, size_t count, hipStream_t stream);
HIPSHIM_API hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags);
HIPSHIM_API hipError_t hipHostFree(void *ptr);
HIPSHIM_API hipError_t hipHostRegister(void *hostPtr, size_t sizeBytes, unsigned int flags);
HIPSHIM_API hipError_t hipHostUnregister(void *hostPtr);
HIPSHIM_API hipError_t hipHostGetDevicePointer(void **devPtr, void *hstPtr, unsigned int flags);
HIPSHIM_API hipError_t hipPointerGetAttributes(hipPointerAttribute_t *attributes, const void *ptr);

HIPSHIM_API hipError_t hipStreamCreate(hipStream_t *stream);
HIPSHIM_API hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags);
HIPSHIM_API hipError_t hipStreamDestroy(hipStream_t stream);
HIPSHIM_API hipError_t hipStreamSynchronize(hipStream_t stream);
HIPSHIM_API hipError_t hipStreamQuery(hipStream_t stream);
HIPSHIM_API hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned int flags);
HIPSHIM_API hipError_t hipStreamBeginCapture(hipStream_t stream, int mode);
HIPSHIM_API hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t *graph);
HIPSHIM_API hipError_t hipGraphInstantiateWithFlags(hipGraphExec_t *exec, hipGraph_t graph, unsigned long long flags);
HIPSHIM_API hipError_t hipGraphLaunch(hipGraphExec_t exec, hipStream_t stream);
HIPSHIM_API hipError_t hipGraphExecDestroy(hipGraphExec_t exec);
HIPSHIM_API hipError_t hipGraphDestroy(hipGraph_t graph);
HIPSHIM_API hipError_t hipEventCreate(hipEvent_t *event);
HIPSHIM_API hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned int flags);
HIPSHIM_API hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream);
HIPSHIM_API hipError_t hipEventQuery(hipEvent_t event);
HIPSHIM_API hipError_t hipEventSynchronize(hipEvent_t event);
HIPSHIM_API hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop);
HIPSHIM_API hipError_t hipEventDestroy(hipEvent_t event);

HIPSHIM_API hipError_t hipModuleLoadData(hipModule_t *module, const void *image);
HIPSHIM_API hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *kname);
HIPSHIM_API hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY,
                                             unsigned int gridDimZ, unsigned int blockDimX,
                                             unsigned int blockDimY, unsigned int blockDimZ,
                                             unsigned int sharedMemBytes, hipStream_t stream,
                                             void **kernelParams, void **extra);
HIPSHIM_API hipError_t hipModuleUnload(hipModule_t module);

HIPSHIM_API const char *hipGetErrorName(hipError_t hip_error);
HIPSHIM_API const char *hipGetErrorString(hipError_t hipError);
HIPSHIM_API hipError_t hipGetLastError(void);
HIPSHIM_API hipError_t hipPeekAtLastError(void);

#endif

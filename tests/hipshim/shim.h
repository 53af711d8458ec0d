/* Helpers shared by the runtime shim's translation units (not exported). */
#ifndef HIPSHIM_SHIM_H
#define HIPSHIM_SHIM_H

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "hip_abi.h"

/* Translate a CUDA runtime / driver status into a hipError_t member and remember it as the
 * calling thread's last error (hipGetLastError), the way HIP records every failing call. */
hipError_t hipshim_from_cuda(cudaError_t status);
hipError_t hipshim_from_cu(CUresult status);

/* Record an error the shim itself detected (bad argument before any CUDA call). */
hipError_t hipshim_fail(hipError_t status);

/* Driver-API calls need a current context; a thread that has made no runtime call yet has
 * none, so bind the current device's primary context (what the HIP runtime does implicitly). */
hipError_t hipshim_bind_context(void);

#endif

// The CUDA launches of every op, compiled by nvcc (launches.cu) apart from the op entries
// (ops.cpp): nvcc parses a source once for the host and again for each GPU architecture, and
// torch's headers, which the entries need and the kernels do not, were most of that (35 CPU s
// a build for two architectures, 13 without them).
//
// Each `run` launches an op's kernels (launch.h) on `stream`, with `device` current, and
// returns the first CUDA error of its calls, cudaSuccess if none; it launches nothing after an
// error. The caller raises it (C10_CUDA_CHECK), so an error reads as any of torch's.
#pragma once

#include <cuda_runtime_api.h>

#include "fastddp/layout.h"

namespace fastddp::cuda {

template <class Args>
cudaError_t run(int device, cudaStream_t stream, const Args& args);

// Compiled in launches.cu, one for each op's argument struct.
extern template cudaError_t run(int, cudaStream_t, const CompressArgs&);
extern template cudaError_t run(int, cudaStream_t, const DecompressArgs&);
extern template cudaError_t run(int, cudaStream_t, const SumChunksArgs&);
extern template cudaError_t run(int, cudaStream_t, const WidenSumArgs&);
extern template cudaError_t run(int, cudaStream_t, const QuantizeArgs&);
extern template cudaError_t run(int, cudaStream_t, const RequantizeArgs&);
extern template cudaError_t run(int, cudaStream_t, const DequantizeArgs&);
extern template cudaError_t run(int, cudaStream_t, const UnpackArgs&);

// A new stream of fastddp's own on `device` (which must be current: cudaErrorInvalidDevice
// otherwise), not blocking on the legacy default stream, at the device's highest priority or
// its lowest, in `out`. Never destroyed: a few a device and process (fastddp/hooks/runtime.py).
cudaError_t new_stream(int device, bool high_priority, cudaStream_t* out);

// Waits for all work queued on `device` (made current for the wait, then the current again).
cudaError_t synchronize(int device);

}  // namespace fastddp::cuda

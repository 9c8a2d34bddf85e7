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

cudaError_t run(int device, cudaStream_t stream, const CompressArgs& args);
cudaError_t run(int device, cudaStream_t stream, const DecompressArgs& args);
cudaError_t run(int device, cudaStream_t stream, const SumChunksArgs& args);
cudaError_t run(int device, cudaStream_t stream, const WidenSumArgs& args);
cudaError_t run(int device, cudaStream_t stream, const QuantizeArgs& args);
cudaError_t run(int device, cudaStream_t stream, const DequantizeArgs& args);
cudaError_t run(int device, cudaStream_t stream, const UnpackArgs& args);

}  // namespace fastddp::cuda

// Internal header of the CUDA kernel table (csrc/cuda/*.cu). The .cu files include no torch
// headers: they are compiled by nvcc for the GPU, and in the test build by the host compiler under
// the emulator (csrc/cuemu/), which runs the same kernels on CPU tensors.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/kernel_api.h"

// A kernel launch, `AMPFUSE_LAUNCH(grid, block, smem, stream, kernel)(args...)`: the triple-chevron
// launch under nvcc, the emulator's grid runner under cuemu (which force-includes cuemu/cuemu.h).
#if defined(CUEMU)
#define AMPFUSE_LAUNCH(grid, block, smem, stream, ...) \
  CUEMU_LAUNCH(grid, block, smem, stream, __VA_ARGS__)
#else
#define AMPFUSE_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

// The body of a pass that two kernels share (they differ only in how they receive their
// metadata). On the GPU it is inlined into each: a call would pass its arguments through local
// memory and spill the caller's registers around it (ptxas -v: every such kernel had a stack frame
// and 20-260 bytes of spills; tests/test_ptxas.py now allows none). The emulator compiles it once
// and calls it, which only saves host compile time. (GCC's spelling there: a __noinline__ macro
// would break libstdc++'s __attribute__((__noinline__)).)
#if defined(CUEMU)
#define AMPFUSE_PASS_BODY __attribute__((noinline))
#else
#define AMPFUSE_PASS_BODY __forceinline__
#endif

// Shared memory, `AMPFUSE_SHARED(float, slots, [8]);` for `__shared__ float slots[8];`. Under the
// emulator every block finds it filled with 0xFF bytes (a GPU hands a block whatever the previous
// block left), so that a read of a slot no thread of the block wrote shows in the results.
#if defined(CUEMU)
#define AMPFUSE_SHARED(type, name, ...) CUEMU_SHARED(type, name, __VA_ARGS__)
#else
#define AMPFUSE_SHARED(type, name, ...) __shared__ type name __VA_ARGS__
#endif

namespace ampfuse::cuda {

using kernels::DType;
using kernels::KernelTable;
using kernels::LaunchContext;

inline cudaStream_t stream_of(const LaunchContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream);
}

// The CUDA kernel table (amp_kernels.cu); optim_kernels.cu fills its optimizer entries.
const KernelTable& kernel_table();
void fill_optim_kernels(KernelTable& table);
void fill_quant_kernels(KernelTable& table);  // quant_kernels.cu

}  // namespace ampfuse::cuda

// The one entry point of libampfuse_cuemu.so that libampfuse looks up (cpu/ops_cpu.cpp, when
// AMPFUSE_CPU_KERNELS=cuda-emulated): the CUDA kernel table of csrc/cuda/*.cu, compiled for the
// host under the emulator. Compiled like the .cu files (cuemu/cuemu.h force-included).
#include "cuda/kernels.cuh"

extern "C" __attribute__((visibility("default"))) const ampfuse::kernels::KernelTable*
ampfuse_cuemu_kernel_table() {
  return &ampfuse::cuda::kernel_table();
}

// The emulated CUDA kernel table (test builds): csrc/cuda/*.cu compiled for the host under the
// emulator, in libampfuse_cuemu.so. CPU tensors run it with AMPFUSE_CPU_KERNELS=cuda-emulated;
// the emulated CUDA device (csrc/cuemu/device.cpp) runs it for its tensors.
#pragma once

#include "ops/kernel_api.h"

namespace ampfuse::cpu {

// Loaded once from $AMPFUSE_CUEMU_LIBRARY or libampfuse_cuemu.so next to libampfuse; throws,
// saying why, when it cannot be loaded (a build without AMPFUSE_CUDA_EMULATION).
const kernels::KernelTable& emulated_kernel_table();

// The emulated multiprocessor count, $AMPFUSE_CUEMU_SMS (default 1: grids of 4 blocks).
int emulated_num_sms();

}  // namespace ampfuse::cpu

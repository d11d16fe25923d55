// The CPU kernel tables: the kernels of csrc/cpu/kernels/ are compiled once per CPU capability
// (DEFAULT, AVX2, AVX512) into namespaces of those names, each filling a kernels::KernelTable
// (ops/kernel_api.h). csrc/cpu/ops_cpu.cpp chooses one at load time.
//
// parallel_threads_used(): how many distinct threads one parallel pass of that build used
// (diagnostics: proves the kernels were compiled with OpenMP rather than silently serial).
#pragma once

#include "ops/kernel_api.h"

namespace ampfuse::cpu {

// Elements per parallel work item: every pass flattens its tensor list into chunks of at most
// this many elements and runs one at::parallel_for over all of them.
constexpr int64_t kChunkElements = 16384;

#define AMPFUSE_DECLARE_CPU_TABLE(cap)        \
  namespace cap {                             \
  const kernels::KernelTable& kernel_table(); \
  int parallel_threads_used();                \
  }
AMPFUSE_DECLARE_CPU_TABLE(DEFAULT)
AMPFUSE_DECLARE_CPU_TABLE(AVX2)
AMPFUSE_DECLARE_CPU_TABLE(AVX512)
#undef AMPFUSE_DECLARE_CPU_TABLE

}  // namespace ampfuse::cpu

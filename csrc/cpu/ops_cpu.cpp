// The CPU backend: which kernel table runs CPU tensors, and the TORCH_LIBRARY_IMPL blocks.
//
// The table is chosen once, at the first op call:
//   - by default the CPU kernels built for the capability torch itself runs with (DEFAULT, AVX2 or
//     AVX512; honours ATEN_CPU_CAPABILITY);
//   - AMPFUSE_CPU_KERNELS=cuda-emulated: the CUDA kernels (csrc/cuda/*.cu) compiled for the host
//     under the emulator (libampfuse_cuemu.so, built by the test build next to libampfuse), so that
//     every suite can run on CPU tensors through the CUDA kernel code. AMPFUSE_CUEMU_SMS sets the
//     emulated multiprocessor count (default 1: grids of 4 blocks); AMPFUSE_CUEMU_LIBRARY names
//     another build of that library (coverage and mutation builds).
#include <ATen/Version.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cpu/emulated.h"
#include "cpu/kernels/kernels.h"
#include "ops/op_core.h"
#include "ops/op_layer.h"

namespace ampfuse::cpu {
namespace {

using kernels::KernelTable;

const KernelTable& capability_table() {
  const std::string cap = at::get_cpu_capability();
#ifdef AMPFUSE_HAVE_AVX512
  if (cap == "AVX512") return AVX512::kernel_table();
#endif
#ifdef AMPFUSE_HAVE_AVX2
  if (cap == "AVX2" || cap == "AVX512") return AVX2::kernel_table();
#endif
  return DEFAULT::kernel_table();
}

int capability_threads_used() {
  const std::string cap = at::get_cpu_capability();
#ifdef AMPFUSE_HAVE_AVX512
  if (cap == "AVX512") return AVX512::parallel_threads_used();
#endif
#ifdef AMPFUSE_HAVE_AVX2
  if (cap == "AVX2" || cap == "AVX512") return AVX2::parallel_threads_used();
#endif
  return DEFAULT::parallel_threads_used();
}

constexpr const char* kEmulatedLibrary = "libampfuse_cuemu.so";

// The emulated CUDA table from $AMPFUSE_CUEMU_LIBRARY or libampfuse_cuemu.so next to this
// library; null and a message when it cannot be loaded.
const KernelTable* emulated_table(std::string& error) {
  std::string path;
  if (const char* env = std::getenv("AMPFUSE_CUEMU_LIBRARY"); env && *env) {
    path = env;
  } else {
    Dl_info self{};
    if (dladdr(reinterpret_cast<void*>(&capability_table), &self) == 0 || !self.dli_fname) {
      error = "cannot locate libampfuse";
      return nullptr;
    }
    path = self.dli_fname;
    const size_t slash = path.rfind('/');
    path = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + kEmulatedLibrary;
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    error = std::string(dlerror()) +
            " (the emulated CUDA kernels are built by the test build: AMPFUSE_CUDA_EMULATION=ON)";
    return nullptr;
  }
  using Getter = const KernelTable* (*)();
  auto get = reinterpret_cast<Getter>(dlsym(handle, "ampfuse_cuemu_kernel_table"));
  if (!get) {
    error = path + " has no ampfuse_cuemu_kernel_table";
    return nullptr;
  }
  return get();
}

}  // namespace

const KernelTable& emulated_kernel_table() {
  static std::string error;
  static const KernelTable* t = emulated_table(error);
  TORCH_CHECK(t != nullptr, "cannot load the emulated CUDA kernels: ", error);
  return *t;
}

int emulated_num_sms() {
  static const int sms = [] {
    const char* env = std::getenv("AMPFUSE_CUEMU_SMS");
    const int n = env ? std::atoi(env) : 1;
    return n > 0 ? n : 1;
  }();
  return sms;
}

namespace {

struct Selection {
  std::mutex mu;
  std::atomic<const KernelTable*> table{nullptr};
  std::atomic<int> num_sms{1};
};

Selection& selection() {
  static Selection s;
  return s;
}

// Selects the table named `name` ("" or "native": the capability table; "cuda-emulated").
// Returns an empty string or what went wrong.
std::string select(const std::string& name, int num_sms) {
  Selection& s = selection();
  std::lock_guard<std::mutex> lock(s.mu);
  if (name.empty() || name == "native") {
    s.table = &capability_table();
  } else if (name == "cuda-emulated") {
    try {
      s.table = &emulated_kernel_table();
    } catch (const c10::Error& e) {
      return std::string("AMPFUSE_CPU_KERNELS=cuda-emulated: ") + e.what_without_backtrace();
    }
  } else {
    return "AMPFUSE_CPU_KERNELS must be 'native' or 'cuda-emulated', got '" + name + "'";
  }
  s.num_sms = num_sms > 0 ? num_sms : 1;
  return {};
}

const KernelTable& table() {
  Selection& s = selection();
  const KernelTable* t = s.table.load(std::memory_order_acquire);
  if (t) return *t;
  static const std::string error = [] {
    const char* name = std::getenv("AMPFUSE_CPU_KERNELS");
    const char* sms = std::getenv("AMPFUSE_CUEMU_SMS");
    return select(name ? name : "", sms ? std::atoi(sms) : 1);
  }();
  TORCH_CHECK(error.empty(), error, ".");
  return *s.table.load(std::memory_order_acquire);
}

kernels::LaunchContext context(const c10::Device&) {
  kernels::LaunchContext ctx{};
  ctx.num_sms = selection().num_sms.load(std::memory_order_relaxed);
  return ctx;
}

constexpr ops::Backend kBackend{&table, &context, nullptr};

}  // namespace
}  // namespace ampfuse::cpu

// Diagnostics and test controls, read from Python through ctypes and from the C++ tests.
// The name of the table that runs CPU tensors ("DEFAULT", "AVX2", "AVX512" or "cuda-emulated").
extern "C" __attribute__((visibility("default"))) const char* ampfuse_cpu_kernels() {
  return ampfuse::cpu::table().name;
}
// How many threads one parallel pass of the capability kernels used.
extern "C" __attribute__((visibility("default"))) int ampfuse_cpu_parallel_threads_used() {
  return ampfuse::cpu::capability_threads_used();
}
// For tests: switch the table that runs CPU tensors ("native" or "cuda-emulated", with the
// emulated multiprocessor count). Not thread-safe against ops running concurrently. Returns null,
// or a message saying why the switch failed (the selection is then unchanged).
extern "C" __attribute__((visibility("default"))) const char* ampfuse_select_cpu_kernels(
    const char* name, int num_sms) {
  static thread_local std::string error;
  error = ampfuse::cpu::select(name ? name : "", num_sms);
  return error.empty() ? nullptr : error.c_str();
}

TORCH_LIBRARY_IMPL(ampfuse, CPU, m) {
  ampfuse::ops::register_device<ampfuse::cpu::kBackend>(m, c10::DeviceType::CPU);
}

// Sparse tensors reach the same entry points, whose validation rejects them with a clear message
// (GradScaler passes a sparse gradient's coalesced values() instead, as torch's does).
TORCH_LIBRARY_IMPL(ampfuse, SparseCPU, m) {
  ampfuse::ops::register_kernels<ampfuse::cpu::kBackend>(m);
}

// The emulated CUDA device (test builds): torch's PrivateUse1 backend, renamed "cuemu" by
// ampfuse.testing.cuemu, so that the code paths of CUDA tensors run without a GPU.
//
//   - Tensors on cuemu hold host memory (filled with 0xFF bytes when allocated, as the emulator's
//     cudaMalloc does: device memory never starts as zeros).
//   - torch's operators run on them through a boxed fallback that hands the CPU kernels CPU
//     tensors over the same memory (no copy) and gives results back as cuemu tensors; an operator
//     that would wait for the device on a GPU is counted (below).
//   - ampfuse's ops run the CUDA kernel table under the emulator (cpu/emulated.h), registered by
//     the same template as the CUDA key (ops::register_device), with a launch context per stream.
//
// Counted as synchronizing, as on a GPU: a copy to host memory (unless non_blocking into pinned
// memory), a copy from host memory (unless non_blocking from pinned memory), _local_scalar_dense
// (item(), bool(), float()), operators whose output size depends on the data (nonzero,
// masked_select, unique, boolean-mask indexing, ...), and an explicit stream, event or device
// synchronize. ampfuse_cuemu_sync_count() reads the count; a hook, when set, is called with what
// synchronized (Python records its stack there).
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cpu/emulated.h"
#include "ops/op_layer.h"

namespace ampfuse::cuemu_device {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
const c10::Device kDevice(kType, 0);

// ---- synchronizations ---------------------------------------------------------------------------

using SyncHook = void (*)(const char* what);
std::atomic<unsigned long long> g_syncs{0};
std::atomic<SyncHook> g_hook{nullptr};

void synchronized(const std::string& what) {
  g_syncs.fetch_add(1, std::memory_order_relaxed);
  if (SyncHook hook = g_hook.load(std::memory_order_acquire)) hook(what.c_str());
}

// ---- memory -------------------------------------------------------------------------------------

void free_device(void* p) { std::free(p); }

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n != 0) {
      TORCH_CHECK(posix_memalign(&p, 256, n) == 0, "cuemu: out of memory allocating ", n, " bytes.");
      std::memset(p, 0xFF, n);
    }
    return {p, p, &free_device, kDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_device; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
DeviceAllocator g_device_allocator;

// Page-locked host memory, as far as torch can tell: host blocks remembered by address, so that
// is_pinned() and non-blocking copies see them.
struct PinnedAllocator final : c10::Allocator {
  std::mutex mu;
  std::map<uintptr_t, size_t> blocks;  // start -> bytes

  static void release(void* p);
  c10::DataPtr allocate(size_t n) override {
    void* p = std::malloc(n ? n : 1);
    TORCH_CHECK(p != nullptr, "cuemu: out of pinned memory allocating ", n, " bytes.");
    {
      std::lock_guard<std::mutex> lock(mu);
      blocks[reinterpret_cast<uintptr_t>(p)] = n ? n : 1;
    }
    return {p, p, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
  bool contains(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return false;
    --it;
    return a < it->first + it->second;
  }
};
PinnedAllocator& pinned_allocator() {
  static auto* a = new PinnedAllocator();  // leaked: outlives every tensor
  return *a;
}
void PinnedAllocator::release(void* p) {
  {
    PinnedAllocator& a = pinned_allocator();
    std::lock_guard<std::mutex> lock(a.mu);
    a.blocks.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

REGISTER_ALLOCATOR(kType, &g_device_allocator);

// A CPU tensor over `t`'s memory, with its sizes, strides and offset. Its storage is resizable:
// an out= kernel that grows it gets new memory, which the caller adopts (adopt()).
at::Tensor cpu_alias(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  c10::Storage cs(c10::Storage::use_byte_size_t(), s.nbytes(),
                  c10::DataPtr(s.mutable_data(), c10::Device(c10::kCPU)), c10::GetCPUAllocator(),
                  /*resizable=*/true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(cs), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

// A cuemu storage over a CPU storage's memory, keeping it alive.
c10::Storage device_storage_over(const c10::Storage& cpu) {
  auto* keep = new c10::Storage(cpu);
  c10::DataPtr dp(cpu.mutable_data(), keep, [](void* k) { delete static_cast<c10::Storage*>(k); },
                  kDevice);
  return c10::Storage(c10::Storage::use_byte_size_t(), cpu.nbytes(), std::move(dp),
                      &g_device_allocator, /*resizable=*/true);
}

at::Tensor device_tensor(c10::Storage storage, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return out;
}

bool on_device(const at::Tensor& t) { return t.defined() && t.device().type() == kType; }

// ---- the device and its streams -----------------------------------------------------------------

// Work runs when it is queued, so every stream is always idle and every event complete; streams
// exist so that per-stream state (the op layer's workspace and tables) is kept per stream.
thread_local c10::StreamId t_stream = 0;
std::atomic<c10::StreamId> g_next_stream{1};

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  static void check(c10::Device d) {
    TORCH_CHECK(d.type() == kType && d.index() <= 0, "cuemu has one device (cuemu:0), got ", d, ".");
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    check(d);
    return kDevice;
  }
  c10::Device getDevice() const override { return kDevice; }
  void setDevice(c10::Device d) const override { check(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, kDevice, t_stream);
  }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, kDevice, g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const c10::Stream old(c10::Stream::UNSAFE, kDevice, t_stream);
    t_stream = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new int(0);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<int*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { synchronized("stream synchronize"); }
  void synchronizeEvent(void*) const override { synchronized("event synchronize"); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronized("device synchronize"); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex d) const override { GuardImpl::check(c10::Device(kType, d)); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  // Random numbers come from the CPU generator: the fallback runs CPU kernels.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  at::Device getDeviceFromPtr(void*) const override { return kDevice; }
  bool isPinnedPtr(const void* data) const override { return pinned_allocator().contains(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DataPtr fresh = g_device_allocator.allocate(n);
    const size_t keep = std::min(n, impl->nbytes());
    if (keep != 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(n);
  }
};

const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---- torch's operators ---------------------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::kStrided, "cuemu tensors are strided.");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only CPU tensors can be pinned.");
  return at::detail::empty_generic(size, &g_device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::kStrided, "cuemu tensors are strided.");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only CPU tensors can be pinned.");
  return at::detail::empty_strided_generic(size, stride, &g_device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<c10::MemoryFormat> memory_format) {
  return at::native::resize_(self, size, memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  return at::cpu::set_(self, source, offset, size, stride);
}
at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return at::cpu::set_(self, source, 0, {n}, {});
}
at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

// copy_ between cuemu and anything: an element-wise copy over the same memory, counted when a GPU
// would make the host wait.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool to_host = !on_device(dst);
  const bool from_host = !on_device(self);
  if (to_host && !(non_blocking && pinned_allocator().contains(dst.storage().data()))) {
    synchronized("copy to host memory (" + std::string(non_blocking ? "pageable" : "blocking") + ")");
  }
  if (from_host && !(non_blocking && pinned_allocator().contains(self.storage().data()))) {
    synchronized("copy from host memory (" + std::string(non_blocking ? "pageable" : "blocking") + ")");
  }
  at::Tensor d = to_host ? dst : cpu_alias(dst);
  const at::Tensor s = from_host ? self : cpu_alias(self);
  d.copy_(s);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  synchronized("_local_scalar_dense (item, bool, float, int of a tensor)");
  return cpu_alias(self).item();
}

// ---- every other operator: its CPU kernel over the same memory ----------------------------------

// Indexing by tensors: its indices may be CPU tensors next to CUDA ones (elsewhere a CPU tensor of
// more than one element next to device tensors is refused, as CUDA kernels refuse it).
bool is_index(const c10::OperatorName& name) {
  return name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::_index_put_impl_" ||
         name.name == "aten::index_put";
}

// Operators whose output size depends on the data: on a GPU the host waits for the count.
bool data_dependent(const c10::OperatorName& name, const torch::jit::Stack& args) {
  static const std::unordered_set<std::string> ops{
      "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
      "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount", "aten::equal",
      "aten::nonzero_numpy"};
  if (ops.count(name.name)) return true;
  if (name.name == "aten::repeat_interleave") {
    // without output_size, the sum of repeats
    return name.overload_name.rfind("Tensor", 0) == 0 && !args.empty() && args.back().isNone();
  }
  if (is_index(name)) {
    for (const c10::IValue& v : args) {
      if (!v.isList()) continue;
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor() && (e.toTensor().scalar_type() == at::kBool || e.toTensor().scalar_type() == at::kByte)) {
          return true;  // a mask: nonzero first
        }
      }
    }
  }
  return false;
}

struct Aliases {
  // The cuemu tensor each CPU alias stands for, by the alias's storage.
  std::unordered_map<const c10::StorageImpl*, at::Tensor> by_storage;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (original, alias)
  bool host_tensor = false;

  at::Tensor alias(const at::Tensor& t) {
    if (!on_device(t)) {
      if (t.defined() && t.dim() > 0 && t.is_cpu()) host_tensor = true;  // a CPU scalar is allowed
      return t;
    }
    at::Tensor a = cpu_alias(t);
    by_storage[a.storage().unsafeGetStorageImpl()] = t;
    pairs.emplace_back(t, a);
    return a;
  }
  c10::IValue alias(const c10::IValue& v) {
    if (v.isTensor()) return alias(v.toTensor());
    if (v.isDevice() && v.toDevice().type() == kType) return c10::IValue(c10::Device(c10::kCPU));
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(alias(t));
      return out;
    }
    if (v.isList()) {
      const c10::List<c10::IValue> in = v.toList();
      bool any = false;
      for (const c10::IValue& e : in) any = any || e.isTensor();
      if (!any) return v;
      c10::impl::GenericList out(in.elementType());
      for (const c10::IValue& e : in) out.push_back(e.isTensor() ? c10::IValue(alias(e.toTensor())) : e);
      return out;
    }
    return v;
  }

  // A returned CPU tensor as a cuemu tensor: over the original's storage when it is (a view of)
  // an argument, else over the new memory.
  at::Tensor back(const at::Tensor& t) const {
    if (!t.defined() || !t.is_cpu()) return t;
    TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == c10::kStrided, "cuemu holds strided tensors only; this operator "
                                "returned a ", t.layout(), " tensor.");
    auto it = by_storage.find(t.storage().unsafeGetStorageImpl());
    const bool of_argument = it != by_storage.end() && it->second.storage().data() == t.storage().data();
    return device_tensor(of_argument ? it->second.storage() : device_storage_over(t.storage()), t);
  }
  c10::IValue back(const c10::IValue& v) const {
    if (v.isTensor()) return back(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(back(t));
      return out;
    }
    return v;
  }

  // An argument the kernel resized (an out= tensor): the original takes the alias's memory and
  // metadata.
  void adopt() const {
    for (const auto& [orig, a] : pairs) {
      c10::TensorImpl* impl = orig.unsafeGetTensorImpl();
      if (a.storage().data() != orig.storage().data() || a.storage().nbytes() != orig.storage().nbytes()) {
        impl->set_storage_keep_dtype(device_storage_over(a.storage()));
      }
      if (a.sizes() != orig.sizes() || a.strides() != orig.strides() || a.storage_offset() != orig.storage_offset()) {
        impl->set_sizes_and_strides(a.sizes(), a.strides(), a.storage_offset());
      }
    }
  }
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const auto first = static_cast<std::ptrdiff_t>(stack->size() - num_args);
  const torch::jit::Stack originals(stack->begin() + first, stack->end());
  Aliases aliases;
  for (auto it = stack->begin() + first; it != stack->end(); ++it) *it = aliases.alias(*it);
  TORCH_CHECK(!aliases.host_tensor || aliases.pairs.empty() || is_index(schema.operator_name()),
              "Expected all tensors to be on the same device, but found at least two devices, cuemu:0 and cpu! "
              "(when checking arguments for ", schema.operator_name(), ")");
  if (data_dependent(schema.operator_name(), originals)) {
    synchronized(std::string("data-dependent output size: ") + schema.operator_name().name);
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  aliases.adopt();
  // A return that aliases a written argument (in-place and out= ops) is that argument itself;
  // every other return becomes a cuemu tensor.
  const size_t num_returns = schema.returns().size();
  const size_t ret0 = stack->size() - num_returns;
  for (size_t r = 0; r < num_returns; ++r) {
    c10::IValue& v = (*stack)[ret0 + r];
    const auto* ra = schema.returns()[r].alias_info();
    bool same = false;
    for (size_t a = 0; ra != nullptr && ra->isWrite() && a < num_args && !same; ++a) {
      const auto* aa = schema.arguments()[a].alias_info();
      if (aa != nullptr && aa->isWrite() && aa->beforeSets() == ra->beforeSets() && originals[a].isTensor() &&
          on_device(originals[a].toTensor())) {
        v = originals[a];
        same = true;
      }
    }
    if (!same) v = aliases.back(v);
  }
}

}  // namespace

// ---- ampfuse's ops: the CUDA kernel table under the emulator -------------------------------------

namespace {

const kernels::KernelTable& table() { return cpu::emulated_kernel_table(); }

kernels::LaunchContext context(const c10::Device&) {
  kernels::LaunchContext ctx{};
  // A stream handle per cuemu stream (never dereferenced: the emulator runs work at launch).
  ctx.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(t_stream) + 1);
  ctx.num_sms = cpu::emulated_num_sms();
  return ctx;
}

constexpr ops::Backend kBackend{&table, &context, nullptr};

}  // namespace
}  // namespace ampfuse::cuemu_device

extern "C" {
// How many synchronizing operations ran on cuemu since the library was loaded.
__attribute__((visibility("default"))) unsigned long long ampfuse_cuemu_sync_count() {
  return ampfuse::cuemu_device::g_syncs.load(std::memory_order_relaxed);
}
// torch.cuemu.synchronize(): a device synchronize.
__attribute__((visibility("default"))) void ampfuse_cuemu_synchronize() {
  ampfuse::cuemu_device::synchronized("device synchronize");
}
// Called with a description of each synchronizing operation (null: none).
__attribute__((visibility("default"))) void ampfuse_cuemu_set_sync_hook(void (*hook)(const char*)) {
  ampfuse::cuemu_device::g_hook.store(hook, std::memory_order_release);
}
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  namespace d = ampfuse::cuemu_device;
  m.impl("empty.memory_format", d::empty_memory_format);
  m.impl("empty_strided", d::empty_strided);
  m.impl("as_strided", d::as_strided);
  m.impl("resize_", d::resize);
  m.impl("_reshape_alias", d::reshape_alias);
  m.impl("view", d::view);
  m.impl("set_.source_Storage_storage_offset", d::set_storage);
  m.impl("set_.source_Storage", d::set_source_storage);
  m.impl("set_.source_Tensor", d::set_tensor);
  m.impl("_copy_from", d::copy_from);
  m.impl("_copy_from_and_resize", d::copy_from_and_resize);
  m.impl("_local_scalar_dense", d::local_scalar_dense);
}

// Autocast on cuemu casts as on CUDA: torch's CUDA policy lists, for the PrivateUse1 key.
#define ADD_NS(RAW_OP) at::RAW_OP
#define AMPFUSE_CUEMU_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define AMPFUSE_CUEMU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define AMPFUSE_CUEMU_FP32_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define AMPFUSE_CUEMU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using namespace at;  // the lists name Tensor, Scalar, ScalarType as torch's own registration does
  using namespace at::autocast;
  AT_FORALL_LOWER_PRECISION_FP(AMPFUSE_CUEMU_LOWER)
  AT_FORALL_FP32(AMPFUSE_CUEMU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(AMPFUSE_CUEMU_FP32_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(AMPFUSE_CUEMU_PROMOTE)
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&ampfuse::cuemu_device::fallback>());
}

TORCH_LIBRARY_IMPL(ampfuse, PrivateUse1, m) {
  ampfuse::ops::register_device<ampfuse::cuemu_device::kBackend>(m, c10::DeviceType::PrivateUse1);
}

// Persistent workspace and resident metadata tables of the op layer (see call_resources.h).
#include "ops/call_resources.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

namespace ampfuse::detail {
namespace {

// Calls on one stream run in order, so they can share one workspace and one table cache. CPU
// tensors have no stream: calls from different threads may overlap, so each thread has its own.
using Key = std::tuple<int, int, void*, std::thread::id>;

Key key_of(const c10::Device& device, const kernels::LaunchContext& ctx) {
  return {static_cast<int>(device.type()), static_cast<int>(device.index()), ctx.stream,
          ctx.stream == nullptr ? std::this_thread::get_id() : std::thread::id()};
}

at::Tensor bytes_on(size_t n, const c10::Device& device, bool zeroed, bool pinned = false) {
  auto options = at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned);
  const auto size = static_cast<int64_t>(n);
  return zeroed ? at::zeros({size}, options) : at::empty({size}, options);
}

struct Table {
  uint64_t hash;
  std::vector<unsigned char> host;  // the content, to compare on a hash match
  at::Tensor device;                // the resident copy
  bool pinned;                      // used by a CUDA-graph capture: never evicted
};

struct Cache {
  at::Tensor workspace[static_cast<int>(CallResources::Kind::kCount)];  // per kind, see workspace()
  std::list<Table> tables;  // most recently used first
};

constexpr size_t kMaxTables = 64;  // unpinned tables kept per stream

std::mutex g_mutex;
std::map<Key, Cache>& caches() {
  static auto* m = new std::map<Key, Cache>();  // leaked: outlives every static user
  return *m;
}

// For tests: treat every call as if its stream were being captured (fresh workspace zeroed by the
// kernels, no table uploads), so that the capture paths run in emulation too.
std::atomic<bool> g_simulate_capture{false};

uint64_t hash_bytes(const void* data, size_t bytes) {
  // FNV-1a over 8-byte words (tables are 8-byte multiples), then the tail.
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 1469598103934665603ull;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h ^ bytes;
}

}  // namespace

CallResources::CallResources(const ops::Backend& b, const c10::Device& device)
    : ctx_(b.context(device)), device_(device) {
  capturing_ = (b.capturing != nullptr && b.capturing(ctx_)) ||
               g_simulate_capture.load(std::memory_order_relaxed);
  ctx_.workspace_zeroed = false;
  ctx_.resident = &CallResources::resident;
  ctx_.resident_self = this;
}

void* CallResources::workspace(Kind kind, size_t bytes) {
  ctx_.workspace_zeroed = false;
  if (bytes == 0) return nullptr;
  if (capturing_) {
    // The graph keeps this allocation; the kernels zero it on the stream at every replay. On the
    // CPU (the CPU tables and the emulated CUDA table) it is filled with 0xFF bytes first, so that
    // a kernel relying on fresh workspace being zero fails in the tests instead of by luck.
    fresh_ = bytes_on(bytes, device_, /*zeroed=*/false);
    if (device_.is_cpu()) std::memset(fresh_.data_ptr(), 0xFF, bytes);
    return fresh_.data_ptr();
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  at::Tensor& w = caches()[key_of(device_, ctx_)].workspace[static_cast<int>(kind)];
  if (!w.defined() || static_cast<size_t>(w.numel()) < bytes) {
    // Grows geometrically; the old block is freed in stream order (the caching allocator reuses
    // it only for work queued after the calls that used it).
    const size_t old = w.defined() ? static_cast<size_t>(w.numel()) : 0;
    w = bytes_on(std::max(bytes, 2 * old), device_, /*zeroed=*/true);
  }
  ctx_.workspace_zeroed = true;
  used_persistent_ = static_cast<int>(kind);
  return w.data_ptr();
}

void CallResources::failed() {
  if (used_persistent_ < 0) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  caches()[key_of(device_, ctx_)].workspace[used_persistent_] = at::Tensor();
}

const void* CallResources::resident(void* self, const void* host, size_t bytes) {
  auto* r = static_cast<CallResources*>(self);
  const uint64_t h = hash_bytes(host, bytes);
  std::lock_guard<std::mutex> lock(g_mutex);
  Cache& c = caches()[key_of(r->device_, r->ctx_)];
  for (auto it = c.tables.begin(); it != c.tables.end(); ++it) {
    if (it->hash == h && it->host.size() == bytes && std::memcmp(it->host.data(), host, bytes) == 0) {
      it->pinned = it->pinned || r->capturing_;
      c.tables.splice(c.tables.begin(), c.tables, it);
      return c.tables.front().device.const_data_ptr();
    }
  }
  // Not resident: no upload while capturing (the caller falls back to several launches; a
  // capture after one eager step finds its tables here).
  if (r->capturing_) return nullptr;
  Table t{h, std::vector<unsigned char>(static_cast<const unsigned char*>(host),
                                        static_cast<const unsigned char*>(host) + bytes),
          {}, false};
  if (r->device_.is_cpu()) {
    t.device = bytes_on(bytes, r->device_, /*zeroed=*/false);
    std::memcpy(t.device.data_ptr(), host, bytes);
  } else {
    // A pinned staging copy and an asynchronous copy on the call's stream (the host allocator
    // keeps the staging block until the copy has run).
    const at::Tensor staging =
        bytes_on(bytes, c10::Device(c10::kCPU), /*zeroed=*/false, /*pinned=*/true);
    std::memcpy(staging.data_ptr(), host, bytes);
    t.device = bytes_on(bytes, r->device_, /*zeroed=*/false);
    t.device.copy_(staging, /*non_blocking=*/true);
  }
  c.tables.push_front(std::move(t));
  // Evict the least recently used unpinned tables (freed in stream order, as the workspace).
  size_t unpinned = 0;
  for (auto it = c.tables.begin(); it != c.tables.end();) {
    if (!it->pinned && ++unpinned > kMaxTables) {
      it = c.tables.erase(it);
    } else {
      ++it;
    }
  }
  return c.tables.front().device.const_data_ptr();
}

}  // namespace ampfuse::detail

// For tests: see g_simulate_capture. Returns the previous setting.
extern "C" __attribute__((visibility("default"))) int ampfuse_simulate_capture(int on) {
  return ampfuse::detail::g_simulate_capture.exchange(on != 0) ? 1 : 0;
}

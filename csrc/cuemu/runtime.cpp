// cuemu runtime: fibers, the block scheduler (barriers, warp collectives, error detection), the
// grid runner and the subset of the CUDA runtime API the launchers call.
//
// Compiled with hidden visibility into libampfuse_cuemu.so (linked -Bsymbolic): its CUDA runtime
// functions never interpose on the real libcudart a CUDA build of torch loads. Only the cuemu_*
// controls below and the kernel table getter (export.cpp) are exported.
//
// Context switching: Boost.Context's fcontext (Debian libboost-context-dev) when built with
// CUEMU_FIBER_BOOST=1, else glibc ucontext (no dependency, ~10x slower switches: swapcontext
// makes a sigprocmask system call).
#include "cuemu/cuemu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if CUEMU_FIBER_BOOST
#include <boost/context/detail/fcontext.hpp>
#else
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUEMU_ASAN 1
#endif

__thread uint3 threadIdx;
__thread uint3 blockIdx;
__thread uint3 blockDim;
__thread uint3 gridDim;
__thread unsigned cuemu_unfenced;

namespace cuemu {
namespace {

// ---- configuration ------------------------------------------------------------------------------
enum Order { kForward, kReverse, kRandom };

Order parse_order(const char* s, Order dflt) {
  if (!s || !*s) return dflt;
  std::string v(s);
  if (v == "forward") return kForward;
  if (v == "reverse") return kReverse;
  if (v == "random") return kRandom;
  std::fprintf(stderr, "[cuemu] unknown order '%s' (forward|reverse|random)\n", s);
  std::abort();
}

struct Config {
  Order block_order = kForward;
  Order thread_order = kForward;
  uint64_t seed = 1;
  int workers = 1;
  size_t stack_bytes = 256 * 1024;
  bool allow_exited_at_barrier = false;
  bool quiet = false;
  bool abort_on_error = false;
  // CUEMU_STUB_LAUNCHES=1: a launch is checked and counted but runs no block (the kernels' results
  // are then meaningless): for timing everything the host does up to a launch
  // (benchmarks/host_overhead.py).
  bool stub_launches = false;
};

Config load_config() {
  Config c;
  c.block_order = parse_order(std::getenv("CUEMU_BLOCK_ORDER"), kForward);
  c.thread_order = parse_order(std::getenv("CUEMU_THREAD_ORDER"), kForward);
  if (const char* s = std::getenv("CUEMU_SEED")) c.seed = std::strtoull(s, nullptr, 0);
  if (const char* s = std::getenv("CUEMU_WORKERS")) c.workers = std::max(1, std::atoi(s));
  if (const char* s = std::getenv("CUEMU_STACK_KB")) c.stack_bytes = size_t(std::atoi(s)) * 1024;
  if (const char* s = std::getenv("CUEMU_ALLOW_EXITED_AT_BARRIER")) c.allow_exited_at_barrier = *s == '1';
  if (const char* s = std::getenv("CUEMU_QUIET")) c.quiet = *s == '1';
  if (const char* s = std::getenv("CUEMU_ABORT_ON_ERROR")) c.abort_on_error = *s == '1';
  if (const char* s = std::getenv("CUEMU_STUB_LAUNCHES")) c.stub_launches = *s == '1';
  return c;
}

Config& config() {
  static Config c = load_config();
  return c;
}

const char* order_name(Order o) {
  return o == kForward ? "forward" : o == kReverse ? "reverse" : "random";
}

std::atomic<unsigned long long> g_launches{0}, g_blocks{0}, g_switches{0};

std::mutex g_diag_mu;
std::string g_diag, g_diag_taken;

thread_local cudaError_t t_last_error = cudaSuccess;

std::string describe_site(const char* site) { return site ? site : "?"; }

const char* op_name(int op) {
  switch (op) {
    case kShflIdx: return "__shfl_sync";
    case kShflUp: return "__shfl_up_sync";
    case kShflDown: return "__shfl_down_sync";
    case kShflXor: return "__shfl_xor_sync";
    case kBallot: return "__ballot_sync";
    case kAny: return "__any_sync";
    case kAll: return "__all_sync";
    case kSyncWarp: return "__syncwarp";
  }
  return "?";
}

// ---- fibers -------------------------------------------------------------------------------------
#if CUEMU_FIBER_BOOST
namespace bc = boost::context::detail;
#endif

struct Fiber {
  char* stack_lo = nullptr;  // usable stack [stack_lo, stack_lo + stack_size)
  size_t stack_size = 0;
#if CUEMU_FIBER_BOOST
  bc::fcontext_t ctx = nullptr;
#else
  ucontext_t ctx;
#endif
  uint3 tid{};
  int linear = 0;
  enum State { kReady, kWaitBarrier, kWaitWarp, kDone } state = kReady;
  uint64_t result = 0;
  const char* wait_site = nullptr;
  unsigned unfenced = 0;  // cuemu_unfenced while the fiber is switched out
#if CUEMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct WarpColl {
  unsigned mask = 0, arrived = 0;
  int op = 0;
  const char* site = nullptr;
  uint64_t chain = 0;
  uint64_t in[32];
  int arg[32];
  int width[32];
};

// One per OS thread that runs blocks; reused across blocks and launches.
struct BlockRunner {
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stacks_bytes = 0, per_fiber = 0;

  int nthreads = 0, done = 0;
  std::vector<int> ready;
  size_t ready_head = 0;
  int current = -1;
  // __syncthreads in progress
  int bar_count = 0, bar_kind = -1, bar_acc = 0;
  const char* bar_site = nullptr;
  uint64_t bar_chain = 0;
  std::vector<int> bar_waiters;
  std::vector<const void*> shared_seen;  // CUEMU_SHARED variables this block has reached
  WarpColl warps[32];
  bool failed = false;

  EntryFn entry = nullptr;
  void* arg = nullptr;
  const char* kernel_name = "";
  std::mt19937_64 rng;
  unsigned long long switches = 0;

#if CUEMU_FIBER_BOOST
  bc::fcontext_t sched = nullptr;
#else
  ucontext_t sched;
#endif
#if CUEMU_ASAN
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif

  ~BlockRunner() {
    if (stacks) munmap(stacks, stacks_bytes);
  }

  void reserve(int n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t want = (config().stack_bytes + page - 1) / page * page;
    if (static_cast<int>(fibers.size()) >= n && per_fiber == want + page) return;
    if (stacks) munmap(stacks, stacks_bytes);
    per_fiber = want + page;  // one guard page below each stack
    stacks_bytes = per_fiber * static_cast<size_t>(n);
    void* mem = mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      std::perror("[cuemu] mmap of fiber stacks");
      std::abort();
    }
    stacks = static_cast<char*>(mem);
    fibers.assign(static_cast<size_t>(n), Fiber{});
    for (int i = 0; i < n; ++i) {
      char* base = stacks + per_fiber * static_cast<size_t>(i);
      mprotect(base, page, PROT_NONE);
      fibers[i].stack_lo = base + page;
      fibers[i].stack_size = want;
    }
  }

  void push_ready(std::vector<int>& ids) {
    switch (config().thread_order) {
      case kForward: std::sort(ids.begin(), ids.end()); break;
      case kReverse: std::sort(ids.begin(), ids.end(), std::greater<int>()); break;
      case kRandom: std::shuffle(ids.begin(), ids.end(), rng); break;
    }
    for (int i : ids) {
      fibers[i].state = Fiber::kReady;
      ready.push_back(i);
    }
  }

  void fail(const std::string& msg);
  void run_block(uint3 bidx);
  void resume(int i);
  void yield_to_scheduler();
  void check_barrier();
  void on_exit(int i);
  static void fiber_main_body();
};

thread_local BlockRunner* t_runner = nullptr;

BlockRunner& runner() {
  if (!t_runner) t_runner = new BlockRunner();  // per OS thread, leaked at thread exit on purpose
  return *t_runner;
}

void record_diag(const std::string& s) {
  if (!config().quiet) std::fprintf(stderr, "%s", s.c_str());
  std::lock_guard<std::mutex> lk(g_diag_mu);
  g_diag += s;
  if (config().abort_on_error) std::abort();
}

void BlockRunner::fail(const std::string& msg) {
  char head[256];
  const Fiber* f = current >= 0 ? &fibers[current] : nullptr;
  if (f) {
    std::snprintf(head, sizeof head, "[cuemu] %s: block (%u,%u,%u) thread (%u,%u,%u): ", kernel_name,
                  blockIdx.x, blockIdx.y, blockIdx.z, f->tid.x, f->tid.y, f->tid.z);
  } else {
    std::snprintf(head, sizeof head, "[cuemu] %s: block (%u,%u,%u): ", kernel_name, blockIdx.x,
                  blockIdx.y, blockIdx.z);
  }
  if (!failed) record_diag(std::string(head) + msg + "\n");
  failed = true;
}

#if CUEMU_FIBER_BOOST
void fiber_entry(bc::transfer_t t) {
  BlockRunner& r = *static_cast<BlockRunner*>(t.data);
  r.sched = t.fctx;
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r.sched_bottom, &r.sched_size);
#endif
  BlockRunner::fiber_main_body();
}
#else
void fiber_entry() {
  BlockRunner& r = runner();
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r.sched_bottom, &r.sched_size);
#endif
  (void)r;
  BlockRunner::fiber_main_body();
}
#endif

void BlockRunner::fiber_main_body() {
  BlockRunner& r = runner();
  r.entry(r.arg);
  // The thread has returned from the kernel.
  const int me = r.current;
  r.on_exit(me);
  Fiber& f = r.fibers[me];
  f.state = Fiber::kDone;
#if CUEMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, r.sched_bottom, r.sched_size);
#endif
#if CUEMU_FIBER_BOOST
  bc::jump_fcontext(r.sched, nullptr);  // never resumed
#else
  setcontext(&r.sched);
#endif
  std::abort();
}

void BlockRunner::resume(int i) {
  current = i;
  Fiber& f = fibers[i];
  threadIdx = f.tid;
  cuemu_unfenced = f.unfenced;
  ++switches;
#if CUEMU_ASAN
  __sanitizer_start_switch_fiber(&sched_fake, f.stack_lo, f.stack_size);
#endif
#if CUEMU_FIBER_BOOST
  bc::transfer_t t = bc::jump_fcontext(f.ctx, this);
  f.ctx = t.fctx;
#else
  swapcontext(&sched, &f.ctx);
#endif
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(sched_fake, nullptr, nullptr);
#endif
  f.unfenced = cuemu_unfenced;
  current = -1;
}

void BlockRunner::yield_to_scheduler() {
  [[maybe_unused]] Fiber& f = fibers[current];
#if CUEMU_ASAN
  __sanitizer_start_switch_fiber(&f.fake_stack, sched_bottom, sched_size);
#endif
#if CUEMU_FIBER_BOOST
  bc::transfer_t t = bc::jump_fcontext(sched, nullptr);
  sched = t.fctx;
#else
  swapcontext(&f.ctx, &sched);
#endif
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &sched_bottom, &sched_size);
#endif
}

void BlockRunner::check_barrier() {
  if (bar_count == 0 || bar_count + done < nthreads) return;
  if (done > 0 && !config().allow_exited_at_barrier) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "__syncthreads completed by %d threads while %d threads of the block have "
                  "exited (undefined in CUDA); barrier at ",
                  bar_count, done);
    fail(msg + describe_site(bar_site));
    return;
  }
  std::vector<int> w;
  w.swap(bar_waiters);
  const int result = bar_acc;
  for (int i : w) fibers[i].result = static_cast<uint64_t>(result);
  bar_count = 0;
  bar_kind = -1;
  bar_acc = 0;
  bar_site = nullptr;
  push_ready(w);
}

void BlockRunner::on_exit(int i) {
  ++done;
  const int lane = i & 31, warp = i >> 5;
  const WarpColl& w = warps[warp];
  if (w.arrived != 0 && ((w.mask >> lane) & 1u) && !((w.arrived >> lane) & 1u)) {
    char msg[200];
    std::snprintf(msg, sizeof msg, "lane %d exited while lanes 0x%08x wait for it in %s at ", lane,
                  w.arrived, op_name(w.op));
    fail(msg + describe_site(w.site));
    return;
  }
  check_barrier();
}

void BlockRunner::run_block(uint3 bidx) {
  blockIdx = bidx;
  const int n = nthreads;
  reserve(n);
  done = 0;
  ready.clear();
  ready_head = 0;
  bar_count = 0;
  bar_kind = -1;
  bar_acc = 0;
  bar_site = nullptr;
  bar_waiters.clear();
  shared_seen.clear();
  for (auto& w : warps) w.arrived = 0;
  failed = false;
  std::vector<int> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.linear = i;
    f.tid = uint3{static_cast<unsigned>(i) % blockDim.x,
                  (static_cast<unsigned>(i) / blockDim.x) % blockDim.y,
                  static_cast<unsigned>(i) / (blockDim.x * blockDim.y)};
    f.state = Fiber::kReady;
    f.result = 0;
    f.unfenced = 0;
#if CUEMU_FIBER_BOOST
    f.ctx = bc::make_fcontext(f.stack_lo + f.stack_size, f.stack_size, &fiber_entry);
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack_lo;
    f.ctx.uc_stack.ss_size = f.stack_size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, &fiber_entry, 0);
#endif
    ids[i] = i;
  }
  push_ready(ids);
  while (!failed) {
    if (ready_head < ready.size()) {
      const int i = ready[ready_head++];
      if (ready_head == ready.size()) {
        ready.clear();
        ready_head = 0;
      }
      resume(i);
      continue;
    }
    if (done == n) break;
    // Nothing can run: deadlock. Describe who waits where.
    std::string msg = "deadlock: no thread can proceed;";
    char buf[200];
    if (bar_count) {
      std::snprintf(buf, sizeof buf, " %d threads wait in __syncthreads at ", bar_count);
      msg += buf + describe_site(bar_site) + ";";
    }
    for (int w = 0; w < 32; ++w) {
      if (warps[w].arrived) {
        std::snprintf(buf, sizeof buf, " warp %d lanes 0x%08x wait in %s (mask 0x%08x) at ", w,
                      warps[w].arrived, op_name(warps[w].op), warps[w].mask);
        msg += buf + describe_site(warps[w].site) + ";";
      }
    }
    std::snprintf(buf, sizeof buf, " %d threads exited", done);
    msg += buf;
    fail(msg);
  }
#if CUEMU_ASAN
  // Abandoned fibers (kernel error) never returned: clear their frames' stale redzones.
  if (failed) {
    for (int i = 0; i < n; ++i) __asan_unpoison_memory_region(fibers[i].stack_lo, fibers[i].stack_size);
  }
#endif
  g_switches.fetch_add(switches, std::memory_order_relaxed);
  switches = 0;
}

}  // namespace

namespace {

// The dynamic call site of an intrinsic: the return addresses of the frames on the fiber's stack
// from the intrinsic up to the fiber's entry, hashed (the runtime and the kernels are compiled
// with frame pointers; the walk stops at the first frame pointer outside the fiber's stack). Two
// threads at the same source line reached through different calls (a helper's barrier called
// from two branches, inlined twice or not) get different chains.
__attribute__((noinline)) uint64_t call_chain(const Fiber& f) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(f.stack_lo);
  const uintptr_t hi = lo + f.stack_size;
  auto fp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  uint64_t h = 1469598103934665603ull;
  for (int depth = 0; depth < 32 && fp >= lo && fp + 2 * sizeof(void*) <= hi; ++depth) {
    const auto* frame = reinterpret_cast<const uintptr_t*>(fp);
    h = (h ^ frame[1]) * 1099511628211ull;  // the return address
    if (frame[0] <= fp) break;              // callers' frames lie above
    fp = frame[0];
  }
  return h;
}

std::string describe_call(const char* site, uint64_t chain) {
  char buf[40];
  std::snprintf(buf, sizeof buf, " (call path %016llx)", static_cast<unsigned long long>(chain));
  return describe_site(site) + buf;
}

}  // namespace

// ---- intrinsics called from kernels -------------------------------------------------------------
int syncthreads_op(int pred, int kind, const char* site) {
  BlockRunner& r = runner();
  if (r.current < 0) {
    std::fprintf(stderr, "[cuemu] __syncthreads called outside a kernel\n");
    std::abort();
  }
  Fiber& f = r.fibers[r.current];
  const uint64_t chain = call_chain(f);
  if (r.bar_count == 0) {
    r.bar_site = site;
    r.bar_chain = chain;
    r.bar_kind = kind;
    r.bar_acc = kind == 1 ? 1 : 0;
  } else if (std::strcmp(site, r.bar_site) != 0 || chain != r.bar_chain || kind != r.bar_kind) {
    r.fail("divergent __syncthreads: this thread waits at " + describe_call(site, chain) +
           " while other threads wait at " + describe_call(r.bar_site, r.bar_chain));
    r.yield_to_scheduler();  // never resumed: the block is abandoned
  }
  switch (kind) {
    case 0: r.bar_acc += pred != 0; break;
    case 1: r.bar_acc = r.bar_acc && pred != 0; break;
    case 2: r.bar_acc = r.bar_acc || pred != 0; break;
    default: break;
  }
  ++r.bar_count;
  r.bar_waiters.push_back(r.current);
  f.state = Fiber::kWaitBarrier;
  f.wait_site = site;
  r.check_barrier();
  r.yield_to_scheduler();
  return static_cast<int>(f.result);
}


uint64_t warp_collective(CollOp op, unsigned mask, uint64_t bits, int arg, int width,
                         const char* site) {
  BlockRunner& r = runner();
  if (r.current < 0) {
    std::fprintf(stderr, "[cuemu] %s called outside a kernel\n", op_name(op));
    std::abort();
  }
  const int me = r.current;
  Fiber& f = r.fibers[me];
  const int lane = me & 31, warp = me >> 5;
  char buf[256];
  const int lanes_in_warp = std::min(32, r.nthreads - warp * 32);
  const unsigned existing = lanes_in_warp == 32 ? 0xffffffffu : ((1u << lanes_in_warp) - 1u);
  if (!((mask >> lane) & 1u)) {
    std::snprintf(buf, sizeof buf, "%s with mask 0x%08x called by lane %d, which the mask excludes",
                  op_name(op), mask, lane);
    r.fail(buf);
    r.yield_to_scheduler();
  }
  if (mask & ~existing) {
    std::snprintf(buf, sizeof buf, "%s mask 0x%08x names lanes that do not exist (warp has 0x%08x)",
                  op_name(op), mask, existing);
    r.fail(buf);
    r.yield_to_scheduler();
  }
  if (op <= kShflXor && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
    std::snprintf(buf, sizeof buf, "%s width %d is not a power of 2 in [1, 32]", op_name(op), width);
    r.fail(buf);
    r.yield_to_scheduler();
  }
  WarpColl& w = r.warps[warp];
  const uint64_t chain = call_chain(f);
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
    w.site = site;
    w.chain = chain;
  } else if (w.mask != mask || w.op != op || std::strcmp(w.site, site) != 0 || w.chain != chain) {
    std::snprintf(buf, sizeof buf,
                  "divergent warp collective: lane %d calls %s (mask 0x%08x) at ", lane,
                  op_name(op), mask);
    std::string msg = buf + describe_call(site, chain);
    std::snprintf(buf, sizeof buf, " while lanes 0x%08x wait in %s (mask 0x%08x) at ", w.arrived,
                  op_name(w.op), w.mask);
    r.fail(msg + buf + describe_call(w.site, w.chain));
    r.yield_to_scheduler();
  }
  // A lane of the mask that already exited can never arrive.
  for (int l = 0; l < lanes_in_warp; ++l) {
    if (((mask >> l) & 1u) && r.fibers[warp * 32 + l].state == Fiber::kDone) {
      std::snprintf(buf, sizeof buf, "%s mask 0x%08x names lane %d, which has exited", op_name(op),
                    mask, l);
      r.fail(buf);
      r.yield_to_scheduler();
    }
  }
  w.in[lane] = bits;
  w.arg[lane] = arg;
  w.width[lane] = width;
  w.arrived |= 1u << lane;
  f.state = Fiber::kWaitWarp;
  f.wait_site = site;
  if (w.arrived == w.mask) {
    // Everyone is here: compute each lane's result, then release them.
    std::vector<int> ids;
    const unsigned m = w.mask;
    uint64_t ballot = 0;
    for (int l = 0; l < 32; ++l) {
      if ((m >> l) & 1u) ballot |= (w.in[l] != 0 ? 1ull : 0ull) << l;
    }
    for (int l = 0; l < 32; ++l) {
      if (!((m >> l) & 1u)) continue;
      Fiber& fl = r.fibers[warp * 32 + l];
      const int wd = w.width[l], a = w.arg[l];
      const int seg = l & ~(wd - 1);
      int src = l;
      switch (w.op) {
        case kShflIdx: src = seg + (a & (wd - 1)); break;
        case kShflUp: src = (l - seg) >= a ? l - a : l; break;
        case kShflDown: src = (l - seg) + a < wd ? l + a : l; break;
        case kShflXor: {
          const int t = l ^ a;
          src = (t >= seg + wd) ? l : t;  // later groups: own value
          break;
        }
        default: break;
      }
      if (w.op <= kShflXor) {
        if (src < 0 || src > 31 || !((m >> src) & 1u)) {
          std::snprintf(buf, sizeof buf,
                        "%s: lane %d reads lane %d, which is not in the mask 0x%08x (undefined "
                        "value)",
                        op_name(w.op), l, src, m);
          r.fail(buf);
          r.yield_to_scheduler();
        }
        fl.result = w.in[src];
      } else if (w.op == kBallot) {
        fl.result = ballot;
      } else if (w.op == kAny) {
        fl.result = ballot != 0;
      } else if (w.op == kAll) {
        fl.result = ballot == m;
      } else {
        fl.result = 0;
      }
      ids.push_back(warp * 32 + l);
    }
    w.arrived = 0;
    r.push_ready(ids);
  }
  r.yield_to_scheduler();
  return f.result;
}

void block_shared(void* p, size_t bytes) {
  BlockRunner& r = runner();
  if (r.current < 0) return;  // not in a kernel
  if (std::find(r.shared_seen.begin(), r.shared_seen.end(), p) != r.shared_seen.end()) return;
  r.shared_seen.push_back(p);
  std::memset(p, 0xFF, bytes);
}

void unfenced_atomic(const char* what) {
  BlockRunner& r = runner();
  if (r.current < 0) return;
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s after %u __stcg/__ldcg accesses of this thread with no __threadfence() since "
                "(a release fence is missing before an atomic that tells other blocks the data is "
                "ready)",
                what, cuemu_unfenced);
  cuemu_unfenced = 0;
  r.fail(buf);
  r.yield_to_scheduler();  // never resumed: the block is abandoned
}

void report_error(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  runner().fail(buf);
}

// ---- grid -----------------------------------------------------------------------------------------
namespace {

// Worker threads that run blocks next to the launching thread (CUEMU_WORKERS > 1). They live for
// the whole process (and keep their fiber stacks), so a launch costs no thread creation.
class WorkerPool {
 public:
  // Runs fn(w) for every w in [0, n): w = 0 on the calling thread, the others on pool threads;
  // returns when all have returned.
  void run(int n, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(threads_.size()) < n - 1) {
        const int w = static_cast<int>(threads_.size()) + 1;
        threads_.emplace_back([this, w] { loop(w); });
        threads_.back().detach();
      }
      fn_ = &fn;
      wanted_ = n;
      pending_ = n - 1;
      ++job_;
    }
    start_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void loop(int w) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn;
      {
        std::unique_lock<std::mutex> lk(mu_);
        start_.wait(lk, [&] { return job_ != seen; });
        seen = job_;
        if (w >= wanted_) continue;
        fn = fn_;
      }
      (*fn)(w);
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable start_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  int wanted_ = 0, pending_ = 0;
  uint64_t job_ = 0;
};

WorkerPool& pool() {
  static WorkerPool* p = new WorkerPool();  // never destroyed: its threads outlive static teardown
  return *p;
}

bool run_blocks(BlockRunner& r, const std::vector<uint32_t>& order, std::atomic<size_t>& next,
                std::atomic<bool>& stop, dim3 grid) {
  bool ok = true;
  for (;;) {
    if (stop.load(std::memory_order_relaxed)) break;
    const size_t k = next.fetch_add(1, std::memory_order_relaxed);
    if (k >= order.size()) break;
    const uint32_t b = order[k];
    const uint3 bidx{b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)};
    r.run_block(bidx);
    g_blocks.fetch_add(1, std::memory_order_relaxed);
    if (r.failed) {
      ok = false;
      stop = true;
      break;
    }
  }
  return ok;
}

}  // namespace

void run_grid(dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream*/, EntryFn entry, void* arg,
              const char* kernel_name) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  const unsigned long long nthreads =
      static_cast<unsigned long long>(block.x) * block.y * block.z;
  const unsigned long long nblocks = static_cast<unsigned long long>(grid.x) * grid.y * grid.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0 ||
      nthreads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    t_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > 48 * 1024) {  // needs cudaFuncSetAttribute on a GPU; not emulated
    t_last_error = cudaErrorInvalidValue;
    return;
  }
  const Config& c = config();
  if (c.stub_launches) return;
  std::vector<uint32_t> order(nblocks);
  std::iota(order.begin(), order.end(), 0u);
  const unsigned long long launch_no = g_launches.load();
  std::mt19937_64 rng(c.seed * 0x9e3779b97f4a7c15ull + launch_no);
  if (c.block_order == kReverse) std::reverse(order.begin(), order.end());
  if (c.block_order == kRandom) std::shuffle(order.begin(), order.end(), rng);

  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  auto setup = [&](BlockRunner& r, uint64_t salt) {
    gridDim = uint3{grid.x, grid.y, grid.z};
    blockDim = uint3{block.x, block.y, block.z};
    r.nthreads = static_cast<int>(nthreads);
    r.entry = entry;
    r.arg = arg;
    r.kernel_name = kernel_name;
    r.rng.seed(c.seed * 0xbf58476d1ce4e5b9ull + launch_no * 131 + salt);
  };
  bool ok = true;
  const int workers = static_cast<int>(std::min<unsigned long long>(c.workers, nblocks));
  if (workers <= 1) {
    BlockRunner& r = runner();
    setup(r, 0);
    ok = run_blocks(r, order, next, stop, grid);
  } else {
    std::atomic<bool> all_ok{true};
    pool().run(workers, [&](int w) {
      BlockRunner& r = runner();
      setup(r, static_cast<uint64_t>(w) + 1);
      if (!run_blocks(r, order, next, stop, grid)) all_ok = false;
    });
    ok = all_ok;
  }
  if (!ok) t_last_error = cudaErrorLaunchFailure;
}

}  // namespace cuemu

// ---- the CUDA runtime API subset the launchers use (host memory, synchronous) --------------------
extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = cuemu::t_last_error;
  cuemu::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return cuemu::t_last_error; }

// The kernel errors behind the last cudaErrorLaunchFailure this thread reported.
thread_local std::string t_error_text;

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    default: return "cudaError(cuemu)";
  }
}
// For a launch failure: the emulator's diagnostics (divergent barrier, deadlock, ...) since the last
// call, which is what a test needs to see in the exception.
const char* cudaGetErrorString(cudaError_t e) {
  if (e != cudaErrorLaunchFailure) return cudaGetErrorName(e);
  std::string diag;
  {
    std::lock_guard<std::mutex> lk(cuemu::g_diag_mu);
    diag.swap(cuemu::g_diag);
  }
  while (!diag.empty() && diag.back() == '\n') diag.pop_back();
  t_error_text = std::string("cudaErrorLaunchFailure (cuemu: ") +
                 (diag.empty() ? "a kernel error was reported earlier" : diag) + ")";
  return t_error_text.c_str();
}

cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  if (n && !p) return cudaErrorInvalidValue;
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) { return cudaMemsetAsync(p, v, n, nullptr); }
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, enum cudaMemcpyKind, cudaStream_t) {
  if (n && (!d || !s)) return cudaErrorInvalidValue;
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, enum cudaMemcpyKind k) {
  return cudaMemcpyAsync(d, s, n, k, nullptr);
}
cudaError_t cudaMalloc(void** p, size_t n) {
  *p = nullptr;
  if (posix_memalign(p, 256, n ? n : 1) != 0) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xFF, n);  // device memory starts as garbage, never as zeros
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}

__attribute__((visibility("default"))) const char* cuemu_take_diagnostics(void) {
  std::lock_guard<std::mutex> lk(cuemu::g_diag_mu);
  cuemu::g_diag_taken.swap(cuemu::g_diag);
  cuemu::g_diag.clear();
  return cuemu::g_diag_taken.c_str();
}

__attribute__((visibility("default"))) void cuemu_configure(const char* block_order,
                                                            const char* thread_order,
                                                            unsigned long long seed, int workers) {
  cuemu::Config& c = cuemu::config();
  c.block_order = cuemu::parse_order(block_order, c.block_order);
  c.thread_order = cuemu::parse_order(thread_order, c.thread_order);
  c.seed = seed;
  if (workers > 0) c.workers = workers;
}

__attribute__((visibility("default"))) void cuemu_stats(unsigned long long* launches,
                                                        unsigned long long* blocks,
                                                        unsigned long long* switches) {
  *launches = cuemu::g_launches.load();
  *blocks = cuemu::g_blocks.load();
  *switches = cuemu::g_switches.load();
}

// The schedule in effect, e.g. "blocks=random threads=random seed=7 workers=1" (printed by the
// test harnesses so that a failure under a random schedule can be replayed).
__attribute__((visibility("default"))) const char* cuemu_schedule(void) {
  static thread_local std::string text;
  const cuemu::Config& c = cuemu::config();
  text = std::string("blocks=") + cuemu::order_name(c.block_order) +
         " threads=" + cuemu::order_name(c.thread_order) + " seed=" + std::to_string(c.seed) +
         " workers=" + std::to_string(c.workers);
  return text.c_str();
}

}  // extern "C"

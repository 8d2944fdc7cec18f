// A host runner for CUDA kernels (the host emulation, beside cuda_runtime.h): a kernel built by the
// host compiler against these stand-ins runs block after block, each of its threads a fiber on
// one OS thread. A thread runs until it waits (__syncthreads, __syncwarp, a warp collective); a
// barrier lets its threads go when the last live one arrives. cp.async copies land at the wait.
//
// What it checks besides the kernel's results:
//  - a barrier that some threads never reach (divergent __syncthreads, a warp collective with a
//    lane that left) stops the launch with the threads and where they wait, instead of hanging;
//  - dynamic shared memory starts each block filled with 0xCD bytes, so a read before a write (or
//    before the cp.async wait that makes a copy land) gives poison, not the last block's values;
//  - built with AddressSanitizer (the host_emulation_asan_tests target), out-of-bounds reads and
//    writes of global memory, of static __shared__ arrays and of dynamic shared memory past the
//    launch's bytes are errors, as compute-sanitizer's memcheck reports them on a GPU;
//  - a block's threads run in an order (Order::kForward: by index; kReversed: the opposite), the
//    first runnable one in it always next: the lanes of a warp take turns between its barriers,
//    and the first warp runs ahead to the next __syncthreads before the second starts (the two
//    orders: each warp as far ahead of the others as a GPU may let it get, and as far behind);
//    kReversed also lands each cp.async copy at once instead of at the wait (the two ends of when
//    a GPU may land it): a kernel whose result differs between the two orders has a race between
//    its threads (also between warps, across warp collectives), or between its copies and reads.
//
// Not modelled: warps in lockstep (nothing here assumes it, nor may the kernels), memory order
// between blocks (blocks run one after another), partial warp masks (refused), timing.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Fiber switching. On x86-64 Linux: the callee-saved registers, the x87 and SSE control words and
// the stack pointer saved on the old stack and loaded from the new one (a few nanoseconds; glibc's
// swapcontext also sets the signal mask, a system call per switch, ~10x slower in these tests).
// Elsewhere: ucontext.
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#else
#define EMU_ASAN 0
#endif

#if defined(__x86_64__) && defined(__linux__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_context_switch(void** save_sp, void* load_sp);
// (weak: every test file that includes this header defines it; the linker keeps one)
asm(R"(
  .pushsection .text
  .weak emu_context_switch
  .type emu_context_switch, @function
emu_context_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_context_switch, .-emu_context_switch
  .popsection
)");
#else
#define EMU_FAST_SWITCH 0
#endif

namespace emu {

struct FiberContext {
#if EMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc{};
#endif
};

// Makes c start fn() on [stack, stack + bytes) at its first switch; fn must never return.
inline void fiber_init(FiberContext& c, char* stack, size_t bytes, void (*fn)()) {
#if EMU_ASAN
  // (A fiber left inside a function, as a stuck launch leaves them, leaves its frames' redzones
  // poisoned on the stack that the next launch reuses.)
  __asan_unpoison_memory_region(stack, bytes);
#endif
#if EMU_FAST_SWITCH
  // From the top: a zero, fn as the return address of the switch (so that fn starts with the stack
  // aligned as after a call), six zero registers, then the control words.
  uint64_t* p = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15));
  *--p = 0;
  *--p = reinterpret_cast<uint64_t>(fn);
  for (int i = 0; i < 6; ++i) *--p = 0;
  p -= 2;
  uint16_t cw;
  uint32_t mxcsr;
  asm volatile("fnstcw %0" : "=m"(cw));
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  std::memcpy(p, &cw, sizeof cw);
  std::memcpy(reinterpret_cast<char*>(p) + 8, &mxcsr, sizeof mxcsr);
  c.sp = p;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fn, 0);
#endif
}

inline void fiber_switch(FiberContext& from, FiberContext& to) {
#if EMU_FAST_SWITCH
  emu_context_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// The dynamic shared memory of the block that runs (ops/cuda/dynamic_smem.cuh): one buffer, since
// blocks run one at a time. Static __shared__ arrays are function statics (cuda_runtime.h): shared
// by the block's threads too, but not poisoned.
inline constexpr size_t kEmuSharedBytes = 256 * 1024;
alignas(128) inline uint8_t g_dynamic_smem[kEmuSharedBytes];
inline uint8_t* dynamic_smem() { return g_dynamic_smem; }

enum class Order { kForward, kReversed };

struct CopyOp {
  void* dst;
  const void* src;
  size_t n;
};

struct Barrier {
  int arrived = 0;
  const char* what = "";
  bool whole_block = false;  // __syncthreads: waits for the block's live threads; else `count`
  int count = 32;            // a warp's 32 lanes, or a named barrier's thread count
  std::vector<int> waiters;
};

struct Thread {
  FiberContext ctx;
  char* stack = nullptr;
  uint3 idx;
  int linear = 0;
  enum State { kRunnable, kWaiting, kDone } state = kRunnable;
  Barrier* waiting_on = nullptr;
  std::vector<std::vector<CopyOp>> committed;  // cp.async groups not yet waited for
  std::vector<CopyOp> open;                    // cp.async copies not yet committed
};

class Runner {
 public:
  static constexpr size_t kStackBytes = 256 * 1024;

  ~Runner() {
    for (Thread& t : threads_)
      if (t.stack) munmap(t.stack, kStackBytes);
  }

  // The runner of this OS thread (its fiber stacks kept from launch to launch).
  static Runner& instance() {
    static thread_local Runner r;
    return r;
  }

  // Runs body() as every thread of every block of grid x block, with `smem` bytes of dynamic
  // shared memory; throws std::runtime_error on a stuck barrier or too much shared memory.
  void launch(dim3 grid, dim3 block, size_t smem, Order order, const std::function<void()>& body) {
    if (smem > kEmuSharedBytes)
      throw std::runtime_error("emu: " + std::to_string(smem) + " bytes of dynamic shared memory, more than the " +
                               std::to_string(kEmuSharedBytes) + " emulated");
    const int n = int(block.x * block.y * block.z);
    if (n <= 0 || n % 32 != 0) throw std::runtime_error("emu: blocks of whole warps only, not " + std::to_string(n));
    grid_ = grid;
    block_ = block;
    order_ = order;
    body_ = &body;
    while (int(threads_.size()) < n) {
      threads_.emplace_back();
      void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s == MAP_FAILED) throw std::runtime_error("emu: no memory for a fiber stack");
      threads_.back().stack = static_cast<char*>(s);
    }
    warps_.assign(size_t(n / 32), Warp{});
    Runner* const outer = current_;
    current_ = this;
    for (unsigned bz = 0; bz < grid.z; ++bz)
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) run_block(uint3{bx, by, bz}, n, smem, order);
    current_ = outer;
  }

  static Runner& current() { return *current_; }
  Thread& self() { return threads_[size_t(cur_)]; }
  const uint3& block_idx() const { return block_idx_; }
  const dim3& block_dim() const { return block_; }
  const dim3& grid_dim() const { return grid_; }
  Order order() const { return order_; }

  void sync_block() { wait(block_bar_); }
  void sync_warp() { wait(warps_[size_t(self().linear / 32)].bar); }

  // Named barrier `id` (1..15) of `count` threads (bar.sync / bar.arrive): sync counts this thread
  // and waits until `count` have arrived; arrive counts it and goes on.
  void named_barrier(int id, int count, bool sync) {
    if (id < 1 || id >= int(std::size(named_)) || count <= 0 || count % 32 != 0) {
      std::fprintf(stderr, "emu: named barrier %d of %d threads: ids 1-15, whole warps\n", id, count);
      std::abort();
    }
    Barrier& b = named_[size_t(id)];
    if (b.arrived > 0 && b.count != count) {
      std::fprintf(stderr, "emu: named barrier %d used with %d and %d threads at once\n", id, b.count, count);
      std::abort();
    }
    b.count = count;
    if (sync) {
      wait(b);
    } else {
      ++b.arrived;
      release_if_complete(b, int(block_.x * block_.y * block_.z));
    }
  }

  // Every lane of the calling thread's warp gives v; each gets all 32 values (by lane). Any
  // trivially copyable T (a value, a pointer, a lane's fragments of a tensor-core product).
  template <class T>
  void warp_exchange(const T& v, T out[32]) {
    static_assert(std::is_trivially_copyable_v<T>);
    Warp& w = warps_[size_t(self().linear / 32)];
    // (Sized by the first lane to arrive: every lane of the one before has read by then.)
    if (w.vals.size() < 32 * sizeof(T)) w.vals.resize(32 * sizeof(T));
    std::memcpy(w.vals.data() + size_t(self().linear % 32) * sizeof(T), &v, sizeof v);
    wait(w.bar);
    std::memcpy(out, w.vals.data(), 32 * sizeof(T));
    wait(w.bar);  // (no lane writes again before every lane has read)
  }

 private:
  struct Warp {
    std::vector<unsigned char> vals;  // 32 lanes' values of the collective under way
    Barrier bar{0, "a warp collective", false, 32, {}};
  };

  static void entry() {
    Runner& r = *current_;
    (*r.body_)();
    r.self().state = Thread::kDone;
    --r.live_;
    fiber_switch(r.self().ctx, r.scheduler_);  // (never resumed)
    std::abort();
  }

  void run_block(uint3 b, int n, size_t smem, Order order) {
    block_idx_ = b;
#if EMU_ASAN
    // Past the launch's bytes the buffer is out of bounds, as on a GPU (compute-sanitizer's
    // shared-memory check): a read or write there is an ASan error.
    __asan_unpoison_memory_region(g_dynamic_smem, kEmuSharedBytes);
    __asan_poison_memory_region(g_dynamic_smem + smem, kEmuSharedBytes - smem);
#endif
    std::memset(g_dynamic_smem, 0xCD, smem);
    block_bar_ = Barrier{0, "__syncthreads", true, 0, {}};
    for (Barrier& b : named_) b = Barrier{0, "a named barrier", false, 0, {}};
    for (Warp& w : warps_) w = Warp{};
    live_ = n;
    for (int i = 0; i < n; ++i) {
      Thread& t = threads_[size_t(i)];
      t.linear = i;
      t.idx = uint3{unsigned(i) % block_.x, unsigned(i) / block_.x % block_.y, unsigned(i) / (block_.x * block_.y)};
      t.state = Thread::kRunnable;
      t.waiting_on = nullptr;
      t.committed.clear();
      t.open.clear();
      fiber_init(t.ctx, t.stack, kStackBytes, &Runner::entry);
    }
    // The first runnable thread in the order runs, until it waits or leaves. So a warp whose last
    // lane arrives at a warp barrier goes on at once, and the first warp in the order runs all the
    // way to the next __syncthreads (or its end) before the next warp starts: within a warp the
    // lanes take turns between barriers, and between warps the two orders are the two extremes
    // of how far ahead one warp may get. (first_: the order's position from which to look.)
    first_ = 0;
    for (;;) {
      int k = first_;
      while (k < n && threads_[size_t(at(k, n))].state != Thread::kRunnable) ++k;
      if (k < n) {
        first_ = k;
        cur_ = at(k, n);
        fiber_switch(scheduler_, threads_[size_t(cur_)].ctx);
        continue;
      }
      bool all_done = true;
      for (int i = 0; i < n; ++i) all_done = all_done && threads_[size_t(i)].state == Thread::kDone;
      if (all_done) return;
      release_if_complete(block_bar_, n);  // threads that left count as arrived at __syncthreads
      bool runnable = false;
      for (int i = 0; i < n; ++i) runnable = runnable || threads_[size_t(i)].state == Thread::kRunnable;
      if (!runnable) throw std::runtime_error(stuck_message(n));
      first_ = 0;
    }
  }

  // The thread at position k of the block's order.
  int at(int k, int n) const { return order_ == Order::kForward ? k : n - 1 - k; }

  // The number of threads a barrier waits for: a warp's 32 lanes, or the block's threads that
  // have not left.
  int expected(const Barrier& b) const { return b.whole_block ? live_ : b.count; }

  void release_if_complete(Barrier& b, int) {
    if (b.arrived == 0 || b.arrived < expected(b)) return;
    b.arrived = 0;
    const int n = int(block_.x * block_.y * block_.z);
    for (int i : b.waiters) {
      Thread& t = threads_[size_t(i)];
      t.state = Thread::kRunnable;
      t.waiting_on = nullptr;
      first_ = std::min(first_, at(i, n));  // (at is its own inverse)
    }
    b.waiters.clear();
  }

  void wait(Barrier& b) {
    const int n = int(block_.x * block_.y * block_.z);
    Thread& me = self();
    me.state = Thread::kWaiting;
    me.waiting_on = &b;
    b.waiters.push_back(me.linear);
    ++b.arrived;
    release_if_complete(b, n);
    if (me.state == Thread::kWaiting) fiber_switch(me.ctx, scheduler_);
  }

  std::string stuck_message(int n) const {
    std::string m = "emu: block (" + std::to_string(block_idx_.x) + ", " + std::to_string(block_idx_.y) + ", " +
                    std::to_string(block_idx_.z) + ") is stuck:";
    for (int i = 0; i < n; ++i) {
      const Thread& t = threads_[size_t(i)];
      if (t.state == Thread::kWaiting && (i == 0 || threads_[size_t(i - 1)].waiting_on != t.waiting_on))
        m += " thread " + std::to_string(i) + " (and those after it) waits at " + t.waiting_on->what + ";";
      if (t.state == Thread::kDone && (i == 0 || threads_[size_t(i - 1)].state != Thread::kDone))
        m += " thread " + std::to_string(i) + " (and those after it) has left;";
    }
    return m;
  }

  inline static Runner* current_ = nullptr;
  std::vector<Thread> threads_;
  std::vector<Warp> warps_;
  Barrier block_bar_;
  Barrier named_[16];
  FiberContext scheduler_;
  const std::function<void()>* body_ = nullptr;
  uint3 block_idx_;
  dim3 block_{1}, grid_{1};
  Order order_ = Order::kForward;
  int cur_ = 0;
  int live_ = 0;
  int first_ = 0;  // no thread before this position of the order is runnable
};

// kernel(args...) over grid x block with `smem` bytes of dynamic shared memory.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Order order, Args&&... args) {
  const std::function<void()> body = [&] { kernel(args...); };
  Runner::instance().launch(grid, block, smem, order, body);
}

// The calling thread's index (threadIdx.x + blockDim.x * (threadIdx.y + ...)).
inline const uint3& thread_idx() { return Runner::current().self().idx; }

// cp.async: copies recorded, committed in groups, made when waited for (Order::kReversed: made at
// once).
inline void cp_async(void* dst, const void* src, size_t n) {
  if (Runner::current().order() == Order::kReversed) std::memcpy(dst, src, n);
  else Runner::current().self().open.push_back({dst, src, n});
}
inline void cp_async_commit() {
  Thread& t = Runner::current().self();
  t.committed.push_back(std::move(t.open));
  t.open.clear();
}
// Makes the copies of all committed groups but the newest `keep`.
inline void cp_async_wait(size_t keep) {
  Thread& t = Runner::current().self();
  while (t.committed.size() > keep) {
    for (const CopyOp& c : t.committed.front()) std::memcpy(c.dst, c.src, c.n);
    t.committed.erase(t.committed.begin());
  }
}

}  // namespace emu

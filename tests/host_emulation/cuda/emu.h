// A host runner for CUDA kernels (the host emulation, beside cuda_runtime.h): a kernel built by the
// host compiler against these stand-ins runs block after block, each of its threads a fiber
// (ucontext) on one OS thread. A thread runs until it waits (__syncthreads, a warp collective,
// cp.async waits are immediate); a barrier lets its threads go when the last live one arrives.
//
// What it checks besides the kernel's results:
//  - a barrier that some threads never reach (divergent __syncthreads, a warp collective with a
//    lane that left) stops the launch with the threads and where they wait, instead of hanging;
//  - dynamic shared memory starts each block filled with 0xCD bytes, so a read before a write (or
//    before the cp.async wait that makes a copy land) gives poison, not the last block's values;
//  - Order::kReversed runs a block's threads in the opposite order between barriers: a kernel
//    whose result differs between the two orders has a race between its threads.
//
// Not modelled: warps in lockstep (nothing here assumes it, nor may the kernels), memory order
// between blocks (blocks run one after another), partial warp masks (refused), timing.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The dynamic shared memory every emulated kernel's `extern __shared__ uint8_t name[]` refers to
// (through EMU_DYNAMIC_SHARED): one buffer, since blocks run one at a time.
namespace emu {
inline constexpr size_t kEmuSharedBytes = 256 * 1024;
}
extern "C" {
alignas(128) inline uint8_t emu_dynamic_smem[emu::kEmuSharedBytes];
}
// Declares namespace ns's `name` (the name a kernel of ns gives its dynamic shared memory) as that
// buffer; to be used before the kernel's header is included. (A block-scope extern declaration
// names a variable of its innermost namespace, so the kernel must sit in a named one: ns.)
#define EMU_DYNAMIC_SHARED(ns, name) \
  namespace ns {                     \
  extern uint8_t name[] asm("emu_dynamic_smem"); \
  }

namespace emu {

enum class Order { kForward, kReversed };

struct CopyOp {
  void* dst;
  const void* src;
  size_t n;
};

struct Barrier {
  int arrived = 0;
  const char* what = "";
};

struct Thread {
  ucontext_t ctx{};
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

  void sync_block() { wait(block_bar_); }

  // Every lane of the calling thread's warp gives v; each gets all 32 values (by lane).
  template <class T>
  void warp_exchange(T v, T out[32]) {
    static_assert(sizeof(T) <= 8);
    Warp& w = warps_[size_t(self().linear / 32)];
    std::memcpy(&w.vals[self().linear % 32], &v, sizeof v);
    wait(w.bar);
    for (int l = 0; l < 32; ++l) std::memcpy(&out[l], &w.vals[l], sizeof(T));
    wait(w.bar);  // (no lane writes again before every lane has read)
  }

 private:
  struct Warp {
    uint64_t vals[32] = {};
    Barrier bar{0, "a warp collective"};
  };

  static void entry() {
    Runner& r = *current_;
    (*r.body_)();
    r.self().state = Thread::kDone;
    // (returns to uc_link: the scheduler)
  }

  void run_block(uint3 b, int n, size_t smem, Order order) {
    block_idx_ = b;
    std::memset(emu_dynamic_smem, 0xCD, smem);
    block_bar_ = Barrier{0, "__syncthreads"};
    for (Warp& w : warps_) w = Warp{};
    for (int i = 0; i < n; ++i) {
      Thread& t = threads_[size_t(i)];
      t.linear = i;
      t.idx = uint3{unsigned(i) % block_.x, unsigned(i) / block_.x % block_.y, unsigned(i) / (block_.x * block_.y)};
      t.state = Thread::kRunnable;
      t.waiting_on = nullptr;
      t.committed.clear();
      t.open.clear();
      getcontext(&t.ctx);
      t.ctx.uc_stack.ss_sp = t.stack;
      t.ctx.uc_stack.ss_size = kStackBytes;
      t.ctx.uc_link = &scheduler_;
      makecontext(&t.ctx, &Runner::entry, 0);
    }
    for (;;) {
      bool ran = false, all_done = true;
      for (int k = 0; k < n; ++k) {
        const int i = order == Order::kForward ? k : n - 1 - k;
        if (threads_[size_t(i)].state != Thread::kRunnable) continue;
        cur_ = i;
        swapcontext(&scheduler_, &threads_[size_t(i)].ctx);
        ran = true;
      }
      for (int i = 0; i < n; ++i) all_done = all_done && threads_[size_t(i)].state == Thread::kDone;
      if (all_done) return;
      if (!ran) release_if_complete(block_bar_, n);  // threads that left count as arrived at __syncthreads
      bool runnable = false;
      for (int i = 0; i < n; ++i) runnable = runnable || threads_[size_t(i)].state == Thread::kRunnable;
      if (!runnable) throw std::runtime_error(stuck_message(n));
    }
  }

  // The number of threads a barrier waits for: a warp's 32 lanes, or the block's threads that
  // have not left.
  int expected(const Barrier& b, int n) const {
    if (&b != &block_bar_) return 32;
    int live = 0;
    for (int i = 0; i < n; ++i) live += threads_[size_t(i)].state != Thread::kDone;
    return live;
  }

  void release_if_complete(Barrier& b, int n) {
    if (b.arrived == 0 || b.arrived < expected(b, n)) return;
    b.arrived = 0;
    for (int i = 0; i < n; ++i) {
      Thread& t = threads_[size_t(i)];
      if (t.state == Thread::kWaiting && t.waiting_on == &b) {
        t.state = Thread::kRunnable;
        t.waiting_on = nullptr;
      }
    }
  }

  void wait(Barrier& b) {
    const int n = int(block_.x * block_.y * block_.z);
    Thread& me = self();
    me.state = Thread::kWaiting;
    me.waiting_on = &b;
    ++b.arrived;
    release_if_complete(b, n);
    if (me.state == Thread::kWaiting) swapcontext(&me.ctx, &scheduler_);
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
  ucontext_t scheduler_{};
  const std::function<void()>* body_ = nullptr;
  uint3 block_idx_;
  dim3 block_{1}, grid_{1};
  int cur_ = 0;
};

// kernel(args...) over grid x block with `smem` bytes of dynamic shared memory.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Order order, Args&&... args) {
  Runner r;
  const std::function<void()> body = [&] { kernel(args...); };
  r.launch(grid, block, smem, order, body);
}

// The calling thread's index (threadIdx.x + blockDim.x * (threadIdx.y + ...)).
inline const uint3& thread_idx() { return Runner::current().self().idx; }

// cp.async: copies recorded, committed in groups, made when waited for.
inline void cp_async(void* dst, const void* src, size_t n) { Runner::current().self().open.push_back({dst, src, n}); }
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

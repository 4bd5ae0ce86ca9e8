// The CPU emulator's runtime (contract and model: rheo_emu.h): fibers, the block scheduler,
// barriers, warp operations, shared memory and the launch checks.
#include "rheo_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define RHEO_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RHEO_EMU_ASAN 1
#endif
#endif
#ifdef RHEO_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// Static __shared__ variables of the emulated objects (emu_shared.ld collects their .bss._ZZ*
// sections between these two symbols); weak so that a build without the script still links
// (then shared memory is not poisoned).
extern "C" char rheo_emu_shared_begin[] __attribute__((weak));
extern "C" char rheo_emu_shared_end[] __attribute__((weak));

namespace rheo_emu {
namespace detail {

// --- context switch --------------------------------------------------------------------------
// x86-64 System V: the callee-saved registers go on the old stack, the stack pointer is saved,
// the new one loaded, its registers popped. No signal mask, no system call (swapcontext costs
// ~1 us a switch through sigprocmask); the floating-point control words are left as they are
// (no code here changes them).
#if defined(__x86_64__)
extern "C" void rheo_emu_switch(void** save_sp, void* load_sp);
extern "C" void rheo_emu_trampoline();
asm(R"(
.text
.globl rheo_emu_switch
.type rheo_emu_switch, @function
rheo_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size rheo_emu_switch, .-rheo_emu_switch
.globl rheo_emu_trampoline
.type rheo_emu_trampoline, @function
rheo_emu_trampoline:
  movq %r12, %rdi
  andq $-16, %rsp
  call *%r13
  ud2
.size rheo_emu_trampoline, .-rheo_emu_trampoline
.section .note.GNU-stack,"",@progbits
.text
)");
#endif

enum class State { kRunnable, kBarrier, kWarp, kExited };

struct Fiber {
  unsigned tid = 0;  // linear thread index in the block
  uint3 idx{0, 0, 0};
  State state = State::kRunnable;
  // barrier
  const char* site_file = nullptr;
  int site_line = 0;
  int pred = 0, result = 0;
  // warp operation
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  uint64_t value = 0, out = 0;
  int arg = 0, width = 32;
  // stack
  char* stack = nullptr;  // lowest usable address (a guard page sits below it)
  size_t stack_size = 0;
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  void* asan_fake = nullptr;
};

Fiber* current = nullptr;
uint3 block_idx{0, 0, 0};
dim3 block_dim, grid_dim;

uint3 thread_idx() { return current->idx; }
unsigned lane_id() { return current->tid % 32u; }

namespace {

constexpr size_t kStackSize =
#ifdef RHEO_EMU_ASAN
    512 * 1024;
#else
    128 * 1024;
#endif

struct WarpState {
  unsigned waiting = 0;  // lanes waiting at a warp op
  unsigned exited = 0;   // lanes that have returned
};

struct Scheduler {
  void* sp = nullptr;  // the scheduler's (launching thread's) stack pointer while a fiber runs
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<unsigned> runnable;
  unsigned live = 0, exited = 0, at_barrier = 0;
  const Invocation* inv = nullptr;
  bool failed = false;
  std::string error;
  // This launch's dynamic shared memory, exactly the requested size (so AddressSanitizer sees
  // an access past it).
  std::unique_ptr<char[]> dynamic;
  size_t dynamic_bytes = 0;
};

// splitmix64: the schedule's random source (std::mt19937_64 cost a fifth of a switch).
struct SplitMix {
  using result_type = uint64_t;
  uint64_t state = 0;
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t{0}; }
  void seed(uint64_t s) { state = s; }
  uint64_t operator()() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

Scheduler sched;
uint64_t seed_value = 0;
SplitMix rng;
cudaError_t last_error = cudaSuccess;
std::string last_message;
Counters stats;
int device = 0;  // cudaSetDevice's choice, an index into kDevices
// cudaFuncAttributeMaxDynamicSharedMemorySize by (device, kernel); absent: 48 KB - static.
std::map<std::pair<int, const void*>, size_t> max_dynamic_smem;

// RHEO_STATIC_SHARED's figures, by kernel (filled during static initialisation, hence a
// function-local map).
struct StaticEntry {
  size_t bytes;
  const char* name;
};
std::map<const void*, StaticEntry>& static_shared_table() {
  static std::map<const void*, StaticEntry> table;
  return table;
}
size_t static_shared_of(const void* kernel) {
  const auto it = static_shared_table().find(kernel);
  return it == static_shared_table().end() ? 0 : it->second.bytes;
}
// What a launch of `kernel` may ask for on the current device: the opt-in, or 48 KB - static.
size_t max_dynamic_of(const void* kernel) {
  const auto it = max_dynamic_smem.find({device, kernel});
  if (it != max_dynamic_smem.end()) return it->second;
  const size_t limit = kDevices[device].shared_default, fixed = static_shared_of(kernel);
  return fixed < limit ? limit - fixed : 0;
}

std::string where(const char* file, int line) {
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  return std::string(base) + ":" + std::to_string(line);
}

char* map_stack(size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
  return static_cast<char*>(p) + page;
}

// Stacks are kept across blocks and launches (mmap once per thread slot).
std::vector<char*> stack_pool;

void switch_to_fiber(Fiber& f) {
  current = &f;
  ++stats.switches;
#ifdef RHEO_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, f.stack_size);
#endif
#if defined(__x86_64__)
  rheo_emu_switch(&sched.sp, f.sp);
#else
  swapcontext(&sched.uc, &f.uc);
#endif
#ifdef RHEO_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  current = nullptr;
}

// From a fiber back to the scheduler; returns when the scheduler resumes this fiber.
void yield_to_scheduler(bool dying) {
  Fiber& f = *current;
#ifdef RHEO_EMU_ASAN
  __sanitizer_start_switch_fiber(dying ? nullptr : &f.asan_fake, sched.main_stack_bottom,
                                 sched.main_stack_size);
#else
  (void)dying;
#endif
#if defined(__x86_64__)
  rheo_emu_switch(&f.sp, sched.sp);
#else
  swapcontext(&f.uc, &sched.uc);
#endif
#ifdef RHEO_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.asan_fake, nullptr, nullptr);
#endif
}

void fiber_main(Fiber* f) {
#ifdef RHEO_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &sched.main_stack_bottom, &sched.main_stack_size);
#endif
  sched.inv->run(sched.inv->ctx);
  f->state = State::kExited;
  --sched.live;
  ++sched.exited;
  yield_to_scheduler(/*dying=*/true);
  std::abort();  // never resumed
}

#if !defined(__x86_64__)
void fiber_entry_uc(unsigned hi, unsigned lo) {
  fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

void prepare_fiber(Fiber& f) {
  f.state = State::kRunnable;
  f.stack_size = kStackSize;
#ifdef RHEO_EMU_ASAN
  // A fiber abandoned mid-kernel (a failed launch) or ended inside fiber_main leaves its frames'
  // red zones behind; the stack is reused, so clear them.
  __asan_unpoison_memory_region(f.stack, f.stack_size);
#endif
#if defined(__x86_64__)
  // Initial frame popped by rheo_emu_switch: r15 r14 r13 r12 rbx rbp, then the return address.
  void** top = reinterpret_cast<void**>(f.stack + f.stack_size);
  top -= 8;  // keeps 16-byte alignment of the area; trampoline re-aligns anyway
  top[0] = nullptr;                                       // r15
  top[1] = nullptr;                                       // r14
  top[2] = reinterpret_cast<void*>(&fiber_main);          // r13: what the trampoline calls
  top[3] = &f;                                            // r12: its argument
  top[4] = nullptr;                                       // rbx
  top[5] = nullptr;                                       // rbp
  top[6] = reinterpret_cast<void*>(&rheo_emu_trampoline);  // return address
  top[7] = nullptr;
  f.sp = top;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = f.stack_size;
  f.uc.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry_uc), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xFFFFFFFFu));
#endif
}

std::string describe_waits() {
  std::map<std::string, int> counts;
  for (const Fiber& f : sched.fibers) {
    std::string what;
    switch (f.state) {
      case State::kRunnable: what = "runnable"; break;
      case State::kExited: what = "exited"; break;
      case State::kBarrier: what = "__syncthreads at " + where(f.site_file, f.site_line); break;
      case State::kWarp: what = "warp op at " + where(f.site_file, f.site_line); break;
    }
    ++counts[what];
  }
  std::ostringstream os;
  bool first = true;
  for (const auto& [what, n] : counts) {
    os << (first ? "" : ", ") << n << " " << what;
    first = false;
  }
  return os.str();
}

void set_failure(const std::string& message) {
  if (!sched.failed) {
    sched.failed = true;
    std::ostringstream os;
    os << message << " (block (" << block_idx.x << ", " << block_idx.y << ", " << block_idx.z
       << "), schedule seed " << seed_value << ")";
    sched.error = os.str();
  }
}

// All live threads wait at a barrier: check it is one barrier for the whole block, release it.
void release_barrier() {
  const Fiber* first = nullptr;
  int or_ = 0, and_ = 1, count = 0;
  for (const Fiber& f : sched.fibers) {
    if (f.state != State::kBarrier) continue;
    if (first == nullptr) first = &f;
    if (f.site_line != first->site_line ||
        (f.site_file != first->site_file && std::strcmp(f.site_file, first->site_file) != 0)) {
      set_failure("threads of one block wait at two different barriers: " +
                  where(first->site_file, first->site_line) + " and " +
                  where(f.site_file, f.site_line));
      return;
    }
    or_ |= f.pred;
    and_ &= f.pred;
    count += f.pred;
  }
  if (sched.exited > 0) {
    set_failure("__syncthreads at " + where(first->site_file, first->site_line) +
                " reached by " + std::to_string(sched.at_barrier) + " of " +
                std::to_string(sched.fibers.size()) + " threads (" +
                std::to_string(sched.exited) + " exited before it)");
    return;
  }
  for (Fiber& f : sched.fibers) {
    if (f.state != State::kBarrier) continue;
    switch (static_cast<Barrier>(f.result)) {  // result holds the kind until release
      case Barrier::kPlain: f.result = 0; break;
      case Barrier::kOr: f.result = or_; break;
      case Barrier::kAnd: f.result = and_; break;
      case Barrier::kCount: f.result = count; break;
    }
    f.state = State::kRunnable;
    sched.runnable.push_back(f.tid);
  }
  sched.at_barrier = 0;
}

unsigned lanes_present(unsigned warp) {
  const unsigned n = static_cast<unsigned>(sched.fibers.size());
  const unsigned first = warp * 32u, count = std::min(32u, n - first);
  return count == 32 ? 0xFFFFFFFFu : ((1u << count) - 1u);
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kMatchAny: return "__match_any_sync";
  }
  return "warp op";
}

// The lanes of `warp` waiting with `mask` are complete: compute every lane's result.
void complete_warp_op(unsigned warp, unsigned mask) {
  Fiber* lanes[32] = {};
  for (unsigned l = 0; l < 32; ++l)
    if (mask >> l & 1u) lanes[l] = &sched.fibers[warp * 32 + l];
  const Fiber& lead = *lanes[__builtin_ctz(mask)];
  for (unsigned l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    if (f == nullptr) continue;
    if (f->op != lead.op || f->site_line != lead.site_line ||
        (f->site_file != lead.site_file && std::strcmp(f->site_file, lead.site_file) != 0)) {
      set_failure(std::string("lanes of warp ") + std::to_string(warp) + " meet with mask 0x" +
                  [&] { char b[16]; std::snprintf(b, sizeof b, "%08x", mask); return std::string(b); }() +
                  " at two different warp operations: " + op_name(lead.op) + " at " +
                  where(lead.site_file, lead.site_line) + " and " + op_name(f->op) + " at " +
                  where(f->site_file, f->site_line));
      return;
    }
  }
  uint64_t ballot = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (lanes[l] != nullptr && lanes[l]->value != 0) ballot |= 1ull << l;
  for (unsigned l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    if (f == nullptr) continue;
    const int w = f->width;
    const int seg = static_cast<int>(l) / w * w;
    int src = static_cast<int>(l);
    switch (f->op) {
      case WarpOp::kShflIdx: src = seg + ((f->arg % w) + w) % w; break;
      case WarpOp::kShflXor: src = static_cast<int>(l) ^ f->arg; if (src / w > static_cast<int>(l) / w || src > 31) src = static_cast<int>(l); break;
      case WarpOp::kShflUp: src = static_cast<int>(l) - f->arg; if (src < seg) src = static_cast<int>(l); break;
      case WarpOp::kShflDown: src = static_cast<int>(l) + f->arg; if (src >= seg + w) src = static_cast<int>(l); break;
      default: break;
    }
    switch (f->op) {
      case WarpOp::kShflIdx: case WarpOp::kShflXor: case WarpOp::kShflUp: case WarpOp::kShflDown:
        if (lanes[src] == nullptr) {
          set_failure(std::string(op_name(f->op)) + " at " + where(f->site_file, f->site_line) +
                      ": lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
                      ", which is not in the mask (undefined on a GPU)");
          return;
        }
        f->out = lanes[src]->value;
        break;
      case WarpOp::kBallot: f->out = ballot; break;
      case WarpOp::kAny: f->out = ballot != 0; break;
      case WarpOp::kAll: f->out = ballot == mask; break;
      case WarpOp::kSync: f->out = 0; break;
      case WarpOp::kMatchAny: {
        uint64_t same = 0;
        for (unsigned k = 0; k < 32; ++k)
          if (lanes[k] != nullptr && lanes[k]->value == f->value) same |= 1ull << k;
        f->out = same;
        break;
      }
    }
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (lanes[l] == nullptr) continue;
    lanes[l]->state = State::kRunnable;
    sched.runnable.push_back(lanes[l]->tid);
  }
}

std::string hex(unsigned x) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", x);
  return b;
}

// A lane arrived at a warp op: check its mask against the lanes there; complete when all came.
// Waiting lanes form groups of one mask each (overlapping masks are an error), so one waiting
// lane of the new lane's mask stands for its whole group: O(1) per arrival.
void warp_arrived(Fiber& f) {
  const unsigned warp = f.tid / 32, lane = f.tid % 32;
  const unsigned present = lanes_present(warp);
  WarpState& ws = sched.warps[warp];
  const auto at = [&f] { return std::string(op_name(f.op)) + " at " + where(f.site_file, f.site_line); };
  if (!(f.mask >> lane & 1u)) {
    set_failure(at() + ": lane " + std::to_string(lane) + " calls it with mask " + hex(f.mask) +
                ", which does not include itself");
    return;
  }
  if (f.mask & ~present) {
    set_failure(at() + ": mask " + hex(f.mask) + " names lanes that do not exist (warp " +
                std::to_string(warp) + " has lanes " + hex(present) + ")");
    return;
  }
  if (f.mask & ws.exited) {
    set_failure(at() + ": mask " + hex(f.mask) + " includes lane " +
                std::to_string(__builtin_ctz(f.mask & ws.exited)) + ", which has exited");
    return;
  }
  const unsigned waiting = ws.waiting & f.mask;
  if (waiting != 0) {
    const Fiber& o = sched.fibers[warp * 32 + __builtin_ctz(waiting)];
    if (o.mask != f.mask) {
      set_failure(at() + ": lanes " + std::to_string(lane) + " and " +
                  std::to_string(o.tid % 32) + " pass different masks (" + hex(f.mask) + ", " +
                  hex(o.mask) + ")");
      return;
    }
  }
  ws.waiting |= 1u << lane;
  if ((ws.waiting & f.mask) == f.mask) {
    ws.waiting &= ~f.mask;
    complete_warp_op(warp, f.mask);
  }
}

void run_block() {
  const unsigned n = static_cast<unsigned>(sched.fibers.size());
  sched.live = n;
  sched.exited = 0;
  sched.at_barrier = 0;
  sched.runnable.clear();
  sched.warps.assign((n + 31) / 32, WarpState{});
  for (unsigned t = 0; t < n; ++t) {
    prepare_fiber(sched.fibers[t]);
    sched.runnable.push_back(t);
  }
  if (seed_value != 0) std::shuffle(sched.runnable.begin(), sched.runnable.end(), rng);
  std::reverse(sched.runnable.begin(), sched.runnable.end());  // in-order mode: thread 0 first
  while (!sched.failed && sched.live > 0) {
    if (sched.runnable.empty()) {
      if (sched.at_barrier == sched.live) {
        release_barrier();
        continue;
      }
      set_failure("deadlock: no thread can run (" + describe_waits() + ")");
      break;
    }
    size_t pick = sched.runnable.size() - 1;
    if (seed_value != 0) pick = static_cast<size_t>(rng() % sched.runnable.size());
    const unsigned t = sched.runnable[pick];
    sched.runnable[pick] = sched.runnable.back();
    sched.runnable.pop_back();
    switch_to_fiber(sched.fibers[t]);
    Fiber& f = sched.fibers[t];
    if (f.state == State::kWarp) warp_arrived(f);
    if (f.state == State::kBarrier) ++sched.at_barrier;
    if (f.state == State::kExited) {
      // A lane that exits while others of its warp wait for it at a warp op: they never finish.
      WarpState& ws = sched.warps[f.tid / 32];
      ws.exited |= 1u << (f.tid % 32);
      for (unsigned w = ws.waiting; w != 0; w &= w - 1) {
        const Fiber& o = sched.fibers[f.tid / 32 * 32 + __builtin_ctz(w)];
        if (o.mask >> (f.tid % 32) & 1u) {
          set_failure(std::string(op_name(o.op)) + " at " + where(o.site_file, o.site_line) +
                      ": mask " + hex(o.mask) + " includes lane " + std::to_string(f.tid % 32) +
                      ", which has exited");
          break;
        }
      }
    }
  }
}

void poison(uint8_t byte) {
  if (rheo_emu_shared_begin != nullptr && rheo_emu_shared_end != nullptr)
    std::memset(rheo_emu_shared_begin, byte, static_cast<size_t>(rheo_emu_shared_end -
                                                                  rheo_emu_shared_begin));
  if (sched.dynamic_bytes > 0) std::memset(sched.dynamic.get(), byte, sched.dynamic_bytes);
}

cudaError_t launch_error(cudaError_t err, const std::string& message) {
  last_error = err;
  last_message = message;
  std::fprintf(stderr, "rheo_emu: %s\n", message.c_str());
  return err;
}

}  // namespace

void* dynamic_shared() { return sched.dynamic_bytes > 0 ? sched.dynamic.get() : nullptr; }

[[noreturn]] void fail_in_kernel(const std::string& message) {
  set_failure(message);
  current->state = State::kExited;
  yield_to_scheduler(/*dying=*/true);
  std::abort();
}

uint64_t warp_op(const char* file, int line, WarpOp op, unsigned mask, uint64_t value, int arg,
                 int width) {
  Fiber& f = *current;
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fail_in_kernel(std::string(op_name(op)) + " at " + where(file, line) + ": width " +
                   std::to_string(width) + " is not a power of 2 in [1, 32]");
  f.state = State::kWarp;
  f.op = op;
  f.mask = mask;
  f.value = op == WarpOp::kBallot || op == WarpOp::kAny || op == WarpOp::kAll ? (value != 0)
                                                                             : value;
  f.arg = arg;
  f.width = width;
  f.site_file = file;
  f.site_line = line;
  yield_to_scheduler(false);
  return f.out;
}

int barrier(const char* file, int line, Barrier kind, int pred) {
  Fiber& f = *current;
  f.state = State::kBarrier;
  f.site_file = file;
  f.site_line = line;
  f.pred = pred;
  f.result = static_cast<int>(kind);
  yield_to_scheduler(false);
  return f.result;
}

// As on a GPU, the opt-in may not take static + dynamic past the device's ceiling.
cudaError_t set_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  ++stats.attribute_sets;
  const DeviceModel& dev = kDevices[device];
  const size_t fixed = static_shared_of(kernel);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      fixed + static_cast<size_t>(value) > dev.shared_optin)
    return launch_error(cudaErrorInvalidValue,
                        "cudaFuncSetAttribute: MaxDynamicSharedMemorySize " +
                            std::to_string(value) + " + " + std::to_string(fixed) +
                            " static bytes is over the " + std::to_string(dev.shared_optin) +
                            "-byte opt-in ceiling of device " + std::to_string(device) + " (" +
                            dev.name + ")");
  max_dynamic_smem[{device, kernel}] = static_cast<size_t>(value);
  return cudaSuccess;
}

cudaError_t get_attributes(cudaFuncAttributes* attr, const void* kernel) {
  ++stats.attribute_reads;
  *attr = cudaFuncAttributes{};
  attr->sharedSizeBytes = static_shared_of(kernel);
  attr->maxDynamicSharedSizeBytes = static_cast<int>(max_dynamic_of(kernel));
  return cudaSuccess;
}

bool register_static_shared(const void* kernel, size_t bytes, const char* name) {
  static_shared_table()[kernel] = StaticEntry{bytes, name};
  return true;
}

cudaError_t launch(const Invocation& inv, dim3 grid, dim3 block, size_t dynamic_smem,
                   const char* file, int line) {
  const std::string at = "launch at " + where(file, line) + ": ";
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0)
    return launch_error(cudaErrorInvalidConfiguration, at + "a grid or block dimension is 0");
  if (threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    return launch_error(cudaErrorInvalidConfiguration,
                        at + "block (" + std::to_string(block.x) + ", " + std::to_string(block.y) +
                            ", " + std::to_string(block.z) +
                            ") exceeds 1024 threads (x, y <= 1024, z <= 64)");
  if (grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535)
    return launch_error(cudaErrorInvalidConfiguration,
                        at + "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) +
                            ", " + std::to_string(grid.z) +
                            ") exceeds the limits (x < 2^31, y and z <= 65535)");
  const bool opted_in = max_dynamic_smem.count({device, inv.kernel}) > 0;
  const size_t fixed = static_shared_of(inv.kernel), max_dynamic = max_dynamic_of(inv.kernel);
  if (dynamic_smem > max_dynamic)
    return launch_error(cudaErrorInvalidValue,
                        at + std::to_string(fixed) + " static + " + std::to_string(dynamic_smem) +
                            " dynamic bytes of shared memory exceed the " +
                            std::to_string(fixed + max_dynamic) + "-byte limit on device " +
                            std::to_string(device) + " (" + kDevices[device].name + ")" +
                            (opted_in ? " set by cudaFuncSetAttribute"
                                      : " (48 KB without cudaFuncSetAttribute)"));
  if (current != nullptr)
    return launch_error(cudaErrorLaunchFailure, at + "a kernel launched from device code");

  ++stats.launches;
  sched.inv = &inv;
  sched.failed = false;
  sched.error.clear();
  sched.dynamic_bytes = dynamic_smem;
  sched.dynamic.reset(dynamic_smem > 0 ? new char[dynamic_smem] : nullptr);  // new[]: 16-aligned
  const unsigned n = static_cast<unsigned>(threads);
  sched.fibers.assign(n, Fiber{});
  while (stack_pool.size() < n) {
    char* s = map_stack(kStackSize);
    if (s == nullptr) return launch_error(cudaErrorMemoryAllocation, at + "mmap of a stack failed");
    stack_pool.push_back(s);
  }
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = sched.fibers[t];
    f.tid = t;
    f.idx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    f.stack = stack_pool[t];
  }
  block_dim = block;
  grid_dim = grid;
  const uint64_t n_blocks = uint64_t(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> order(n_blocks);
  for (uint64_t i = 0; i < n_blocks; ++i) order[i] = i;
  if (seed_value != 0) std::shuffle(order.begin(), order.end(), rng);
  const uint8_t poison_byte = seed_value == 0 ? 0xFF : static_cast<uint8_t>(rng() | 1u);
  for (uint64_t i = 0; i < n_blocks && !sched.failed; ++i) {
    const uint64_t b = order[i];
    block_idx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                      static_cast<unsigned>(b / (uint64_t(grid.x) * grid.y))};
    poison(poison_byte);
    ++stats.blocks;
    stats.threads += n;
    run_block();
  }
  sched.inv = nullptr;
  if (sched.failed) return launch_error(cudaErrorLaunchFailure, at + sched.error);
  return cudaSuccess;
}

}  // namespace detail

std::vector<StaticShared> static_shared_figures() {
  std::vector<StaticShared> out;
  for (const auto& [kernel, e] : detail::static_shared_table()) out.push_back({e.name, e.bytes});
  return out;
}

void set_schedule_seed(uint64_t seed) {
  detail::seed_value = seed;
  detail::rng.seed(seed);
}
uint64_t schedule_seed() { return detail::seed_value; }
const std::string& last_error_message() { return detail::last_message; }
Counters counters() { return detail::stats; }
void reset_counters() { detail::stats = Counters{}; }

}  // namespace rheo_emu

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = rheo_emu::detail::last_error;
  rheo_emu::detail::last_error = cudaSuccess;
  return err;
}
cudaError_t cudaPeekAtLastError() { return rheo_emu::detail::last_error; }

cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t) {
  ++rheo_emu::detail::stats.allocations;
  *ptr = std::malloc(bytes == 0 ? 1 : bytes);
  return *ptr == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) {
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = rheo_emu::kDeviceCount;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = rheo_emu::detail::device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= rheo_emu::kDeviceCount) return cudaErrorInvalidValue;
  rheo_emu::detail::device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  ++rheo_emu::detail::stats.attribute_reads;
  if (device < 0 || device >= rheo_emu::kDeviceCount) return cudaErrorInvalidValue;
  const rheo_emu::DeviceModel& d = rheo_emu::kDevices[device];
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(d.shared_default); break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(d.shared_optin); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

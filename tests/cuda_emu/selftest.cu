// Self-test of the CPU emulator (csrc/emu/rheo_emu.h): the semantics the kernels rely on, and
// that each misuse the emulator promises to catch is caught. Compiled as host C++ with the
// emulator (tests/cuda_emu/CMakeLists.txt); run by tests/test_cuda_emu.py.
#include <cuda_runtime.h>

#include <cstdio>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/cpu/cpu_math.h"
#include "check.h"
#include "device_utils.cuh"

namespace {


bool message_has(const char* text) {
  return rheo_emu::last_error_message().find(text) != std::string::npos;
}

// --- semantics -----------------------------------------------------------------------------

__global__ void shuffles(int* out, double* dout, int width) {
  const int t = threadIdx.x, lane = t % 32;
  const int base = t * 8;
  out[base + 0] = __shfl_xor_sync(0xFFFFFFFFu, t, 5, width);
  out[base + 1] = __shfl_up_sync(0xFFFFFFFFu, t, 3, width);
  out[base + 2] = __shfl_down_sync(0xFFFFFFFFu, t, 3, width);
  out[base + 3] = __shfl_sync(0xFFFFFFFFu, t, 7, width);
  out[base + 4] = static_cast<int>(__ballot_sync(0xFFFFFFFFu, lane % 3 == 0));
  out[base + 5] = __any_sync(0xFFFFFFFFu, lane == 31) + 2 * __all_sync(0xFFFFFFFFu, lane < 31);
  out[base + 6] = static_cast<int>(__match_any_sync(0xFFFFFFFFu, lane / 8));
  out[base + 7] = __popc(static_cast<unsigned>(t) * 2654435761u);
  dout[t] = __shfl_xor_sync(0xFFFFFFFFu, 0.5 * t, 1, width);
}

void test_shuffles() {
  for (int width : {32, 16, 8}) {
    std::vector<int> out(64 * 8);
    std::vector<double> dout(64);
    shuffles RHEO_LAUNCH(1, 64, 0, nullptr)(out.data(), dout.data(), width);
    CHECK(cudaGetLastError() == cudaSuccess);
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, seg = lane / width * width, w = t / 32 * 32;
      const int* o = &out[t * 8];
      const int x = lane ^ 5;
      CHECK(o[0] == (x / width > lane / width ? t : w + x));
      CHECK(o[1] == (lane - 3 < seg ? t : t - 3));
      CHECK(o[2] == (lane + 3 >= seg + width ? t : t + 3));
      CHECK(o[3] == w + seg + 7 % width);
      unsigned ballot = 0;
      for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
      CHECK(static_cast<unsigned>(o[4]) == ballot);
      CHECK(o[5] == 1);  // any(lane == 31) = 1, all(lane < 31) = 0
      CHECK(static_cast<unsigned>(o[6]) == 0xFFu << (lane / 8 * 8));
      CHECK(o[7] == __builtin_popcount(static_cast<unsigned>(t) * 2654435761u));
      CHECK(dout[t] == 0.5 * (w + ((lane ^ 1) / width > lane / width ? lane : lane ^ 1)));
    }
  }
}

__global__ void barriers_and_atomics(int* out, double* dout) {
  __shared__ unsigned int counter;
  __shared__ double mass;
  RHEO_DYNAMIC_SHARED(int, dyn);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int n = blockDim.x * blockDim.y * blockDim.z;
  if (t == 0) counter = 0, mass = 0.0;
  dyn[t] = t;
  __syncthreads();
  atomicAdd(&counter, 1u);
  atomicAdd(&mass, 0.25);
  const int sum_or = __syncthreads_or(t == n - 1);
  const int sum_and = __syncthreads_and(t < n);
  const int count = __syncthreads_count(t % 2 == 0);
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (t == 0) {
    out[b * 5 + 0] = static_cast<int>(counter);
    out[b * 5 + 1] = sum_or + 2 * sum_and;
    out[b * 5 + 2] = count;
    out[b * 5 + 3] = dyn[n - 1 - t];
    out[b * 5 + 4] = b;
    dout[b] = mass;
  }
}

void test_barriers_and_atomics() {
  const dim3 grid(3, 2, 2), block(8, 4, 3);  // 96 threads: three warps, 12 blocks
  std::vector<int> out(12 * 5, -1);
  std::vector<double> dout(12);
  barriers_and_atomics RHEO_LAUNCH(grid, block, 96 * sizeof(int), nullptr)(out.data(),
                                                                           dout.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  for (int b = 0; b < 12; ++b) {
    CHECK(out[b * 5 + 0] == 96);
    CHECK(out[b * 5 + 1] == 3);
    CHECK(out[b * 5 + 2] == 48);
    CHECK(out[b * 5 + 3] == 95);
    CHECK(out[b * 5 + 4] == b);  // every block ran once, with its own index
    CHECK(dout[b] == 24.0);
  }
}

// --- 16-bit conversions: the emulator's __half / __nv_bfloat16 against the CPU kernels' ------

void test_conversions() {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const __half h{static_cast<uint16_t>(bits)};
    const __nv_bfloat16 b{static_cast<uint16_t>(bits)};
    const float fh = __half2float(h), fb = __bfloat162float(b);
    const float ch = rheo::cpu::half_to_float(static_cast<uint16_t>(bits));
    const float cb = rheo::cpu::bf16_to_float(static_cast<uint16_t>(bits));
    CHECK((std::isnan(fh) && std::isnan(ch)) || std::memcmp(&fh, &ch, 4) == 0);
    CHECK((std::isnan(fb) && std::isnan(cb)) || std::memcmp(&fb, &cb, 4) == 0);
  }
  // float -> 16 bit: every float whose low 13 (half) / 16 (bf16) bits sit at or around a rounding
  // boundary, over all exponents, plus a sweep.
  uint64_t state = 12345;
  for (int i = 0; i < 2000000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t u = static_cast<uint32_t>(state >> 32);
    if (i % 3 == 0) u = (u & ~0x1FFFu) | (0x1000u + (u & 3u) - 1u);  // near a half tie
    if (i % 3 == 1) u = (u & ~0xFFFFu) | (0x8000u + (u & 3u) - 1u);  // near a bf16 tie
    float f;
    std::memcpy(&f, &u, 4);
    const uint16_t eh = __float2half_rn(f).bits, ch = rheo::cpu::float_to_half(f);
    const uint16_t eb = __float2bfloat16_rn(f).bits, cb = rheo::cpu::float_to_bf16(f);
    if (!std::isnan(f)) CHECK(eh == ch);
    if (!std::isnan(f)) CHECK(eb == cb);
    if (std::isnan(f)) CHECK(std::isnan(__half2float(__float2half_rn(f))));
    if (std::isnan(f)) CHECK(std::isnan(__bfloat162float(__float2bfloat16_rn(f))));
    if (eh != ch || eb != cb) break;
  }
}

// --- misuse that must be caught -------------------------------------------------------------

__global__ void early_exit_then_barrier(int* out) {
  if (threadIdx.x >= 40) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void two_barriers(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void full_mask_partial_warp(int* out) {  // launched with 48 threads: warp 1 has 16
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x), 1);
}

__global__ void divergent_full_mask(int* out) {  // half the warp leaves, the rest shuffles
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x), 1);
}

__global__ void shuffle_vs_barrier(int* out) {  // lanes wait for a lane that waits at a barrier
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x == 3) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

__global__ void reads_outside_mask(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0x0000FFFFu, static_cast<int>(threadIdx.x), 16);
}

__global__ void missing_barrier(int* out) {  // thread 0 publishes, the others read: no barrier
  __shared__ int value;
  if (threadIdx.x == 0) value = 42;
  out[threadIdx.x] = value;
}

__global__ void uninitialised_shared(int* out) {  // every thread reads before anyone writes
  __shared__ int slots[64];
  out[threadIdx.x] = slots[threadIdx.x];
  __syncthreads();
  slots[threadIdx.x] = 7;
}

__global__ void trivial(int* out) { out[threadIdx.x + blockDim.x * blockIdx.x] = 1; }

void test_misuse() {
  std::vector<int> out(2048, 0);
  early_exit_then_barrier RHEO_LAUNCH(1, 64, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("reached by 40 of 64 threads (24 exited before it)"));

  two_barriers RHEO_LAUNCH(1, 64, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("two different barriers"));

  full_mask_partial_warp RHEO_LAUNCH(1, 48, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("names lanes that do not exist"));

  divergent_full_mask RHEO_LAUNCH(1, 32, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("which has exited"));

  shuffle_vs_barrier RHEO_LAUNCH(1, 32, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("deadlock"));

  reads_outside_mask RHEO_LAUNCH(1, 32, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(message_has("not in the mask"));

  trivial RHEO_LAUNCH(1, 2048, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  trivial RHEO_LAUNCH(dim3(1, 70000), 32, 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  trivial RHEO_LAUNCH(1, dim3(8, 8, 65), 0, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  trivial RHEO_LAUNCH(1, 32, 64 * 1024, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(message_has("48 KB without cudaFuncSetAttribute"));
  CHECK(cudaFuncSetAttribute(trivial, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024) ==
        cudaSuccess);
  trivial RHEO_LAUNCH(2, 1024, 64 * 1024, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(out[2047] == 1);
}

// 12 KB of static shared memory, as verification's walk_kernel has: it counts toward every limit.
__global__ void static_12k(int* out) {
  __shared__ int big[3072];
  big[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = big[threadIdx.x ^ 1];
}
RHEO_STATIC_SHARED(12288, static_12k);

// Shared memory as a GPU counts it (issue 30): static + dynamic against 48 KB without an opt-in,
// and against each device's own opt-in ceiling with one; the opt-in belongs to one device.
void test_shared_limits() {
  std::vector<int> out(32);
  cudaFuncAttributes attr;
  CHECK(cudaFuncGetAttributes(&attr, static_12k) == cudaSuccess);
  CHECK(attr.sharedSizeBytes == 12288 && attr.maxDynamicSharedSizeBytes == 48 * 1024 - 12288);
  CHECK(cudaFuncGetAttributes(&attr, trivial) == cudaSuccess && attr.sharedSizeBytes == 0);
  // In device order: each device's launch without its own opt-in fails although the devices
  // before it opted in (the attribute belongs to one device).
  for (int dev = 0; dev < rheo_emu::kDeviceCount; ++dev) {
    CHECK(cudaSetDevice(dev) == cudaSuccess);
    int optin = 0, plain = 0;
    CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess);
    CHECK(cudaDeviceGetAttribute(&plain, cudaDevAttrMaxSharedMemoryPerBlock, dev) == cudaSuccess);
    CHECK(size_t(optin) == rheo_emu::kDevices[dev].shared_optin && plain == 48 * 1024);
    static_12k RHEO_LAUNCH(1, 32, 36 * 1024, nullptr)(out.data());  // 48 KB in all: no opt-in
    CHECK(cudaGetLastError() == cudaSuccess && out[0] == 1);
    static_12k RHEO_LAUNCH(1, 32, 40 * 1024, nullptr)(out.data());  // dynamic alone is under
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(message_has("12288 static + 40960 dynamic"));
    CHECK(message_has("48 KB without cudaFuncSetAttribute"));
    const int room = optin - 12288;
    CHECK(cudaFuncSetAttribute(static_12k, cudaFuncAttributeMaxDynamicSharedMemorySize, room + 1) ==
          cudaErrorInvalidValue);
    CHECK(message_has("opt-in ceiling") && cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(cudaFuncSetAttribute(static_12k, cudaFuncAttributeMaxDynamicSharedMemorySize, room) ==
          cudaSuccess);
    static_12k RHEO_LAUNCH(1, 32, room, nullptr)(out.data());
    CHECK(cudaGetLastError() == cudaSuccess);
    static_12k RHEO_LAUNCH(1, 32, room + 1, nullptr)(out.data());
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  }
  CHECK(cudaSetDevice(1) == cudaSuccess);  // 163 KB: what the 99 KB device 2 refuses
  static_12k RHEO_LAUNCH(1, 32, 140 * 1024, nullptr)(out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaSetDevice(0) == cudaSuccess);
}

// A missing barrier or a read of unwritten shared memory shows up as a difference between
// schedules: run under several seeds and compare.
template <typename Kernel>
bool schedules_differ(Kernel kernel, int threads) {
  std::vector<int> first(threads), again(threads);
  const uint64_t saved = rheo_emu::schedule_seed();
  bool differ = false;
  for (uint64_t seed = 1; seed <= 4 && !differ; ++seed) {
    rheo_emu::set_schedule_seed(seed);
    kernel RHEO_LAUNCH(1, threads, 0, nullptr)(seed == 1 ? first.data() : again.data());
    if (cudaGetLastError() != cudaSuccess) return true;
    differ = seed > 1 && again != first;
  }
  rheo_emu::set_schedule_seed(saved);
  return differ;
}

void test_races_show() {
  CHECK(schedules_differ(missing_barrier, 64));
  CHECK(schedules_differ(uninitialised_shared, 64));
  CHECK(!schedules_differ(trivial, 64));  // and a correct kernel does not differ
}

// The emulator's cost: a shuffle-heavy kernel, timed per fiber switch (printed, not asserted).
__global__ void shuffle_loop(float* out) {
  float x = static_cast<float>(threadIdx.x);
  for (int i = 0; i < 1000; ++i) x = __shfl_xor_sync(0xFFFFFFFFu, x, 1) + 1.0f;
  out[threadIdx.x] = x;
}

double ns_per_switch(uint64_t seed) {
  std::vector<float> out(128);
  const uint64_t saved = rheo_emu::schedule_seed();
  rheo_emu::set_schedule_seed(seed);
  const uint64_t before = rheo_emu::counters().switches;
  const auto t0 = std::chrono::steady_clock::now();
  shuffle_loop RHEO_LAUNCH(1, 128, 0, nullptr)(out.data());
  const auto t1 = std::chrono::steady_clock::now();
  rheo_emu::set_schedule_seed(saved);
  const double switches = static_cast<double>(rheo_emu::counters().switches - before);
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / switches;
}

// One element past the dynamic shared buffer: the negative control of the sanitized build
// (AddressSanitizer must stop the program; tests/test_cuda_emu.py checks that it does).
__global__ void write_past_dynamic_shared(int* out) {
  RHEO_DYNAMIC_SHARED(int, dyn);
  dyn[threadIdx.x + 1] = 1;
  __syncthreads();
  out[threadIdx.x] = dyn[threadIdx.x];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "overflow") {
    std::vector<int> out(32);
    write_past_dynamic_shared RHEO_LAUNCH(1, 32, 32 * sizeof(int), nullptr)(out.data());
    std::printf("overflow: not detected\n");
    return 0;
  }
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  rheo_emu::set_schedule_seed(seed);
  test_shuffles();
  test_barriers_and_atomics();
  test_conversions();
  test_misuse();
  test_shared_limits();
  test_races_show();
  std::printf("cost: %.0f ns a fiber switch in order, %.0f ns in a random schedule\n",
              ns_per_switch(0), ns_per_switch(1));
  const auto c = rheo_emu::counters();
  std::printf("selftest seed %llu: %s (%llu launches, %llu blocks, %llu switches)\n",
              static_cast<unsigned long long>(seed), failures ? "FAILED" : "ok",
              static_cast<unsigned long long>(c.launches),
              static_cast<unsigned long long>(c.blocks),
              static_cast<unsigned long long>(c.switches));
  return failures ? 1 : 0;
}

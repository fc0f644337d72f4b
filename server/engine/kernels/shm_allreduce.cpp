// All-reduce through shared memory for the tensor-parallel ranks of one sharded worker on one host.
//
// gloo's all-reduce goes through loopback TCP: a message, a wake-up and a copy per hop, hundreds of microseconds
// for a few KiB. Here every rank writes its partial sum into its own slot of a segment all of them map, waits at
// a barrier, and adds the slots in rank order: one copy in, one pass out. Adding in rank order makes the result
// independent of the tensor's size (gloo's ring starts each chunk's sum at another rank), so a sharded engine's
// row is the same computation whatever else is in the step.
//
// Segment (created by the driver, one per tensor-parallel group; offsets in bytes):
//
//     0      magic (u32), world (u32), slot_floats (u64), spins (u32: how long a waiter spins first)
//     64     count: ranks arrived at the current barrier (atomic u32)
//     128    phase: barriers completed (atomic u32, the futex word waiters sleep on)
//     192    abort: non-zero once the group failed (atomic u32): every wait returns at once
//     256    slots: 2 (alternate calls) x world x slot_floats fp32
//
// Calls alternate between the two halves of the slots: rank A can write call k+1 while rank B still reads call
// k, and no rank writes call k+2 before every rank arrived at call k+1's barrier, i.e. finished reading call k.
// A waiter spins briefly where every rank has a core of its own (the peers are usually a few microseconds behind),
// then sleeps on the phase futex; where ranks share cores it sleeps at once (spinning would take the core from the
// rank it waits for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint32_t kMagic = 0x53414c52;  // "SALR"
constexpr int64_t kHeaderBytes = 256;

struct Header {
  uint32_t magic;
  uint32_t world;
  uint64_t slot_floats;
  uint32_t spins;
  char pad0[44];
  std::atomic<uint32_t> count;
  char pad1[60];
  std::atomic<uint32_t> phase;
  char pad2[60];
  std::atomic<uint32_t> abort;
};

Header* header_of(const at::Tensor& segment) { return reinterpret_cast<Header*>(segment.data_ptr()); }

float* slot(const at::Tensor& segment, int64_t parity, int64_t rank) {
  Header* h = header_of(segment);
  float* slots = reinterpret_cast<float*>(static_cast<char*>(segment.data_ptr()) + kHeaderBytes);
  return slots + (parity * h->world + rank) * h->slot_floats;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Returns false when the group aborted or `timeout_s` passed.
bool barrier(Header* h, double timeout_s) {
  const uint32_t phase = h->phase.load(std::memory_order_acquire);
  if (h->count.fetch_add(1, std::memory_order_acq_rel) + 1 == h->world) {
    h->count.store(0, std::memory_order_relaxed);
    h->phase.fetch_add(1, std::memory_order_release);
    futex(&h->phase, FUTEX_WAKE, INT_MAX, nullptr);
    return h->abort.load(std::memory_order_acquire) == 0;
  }
  for (uint32_t i = 0; i < h->spins; ++i) {
    if (h->phase.load(std::memory_order_acquire) != phase) return h->abort.load(std::memory_order_acquire) == 0;
    cpu_relax();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const timespec slice{0, 100 * 1000 * 1000};  // wake every 100 ms to look at the deadline
  while (h->phase.load(std::memory_order_acquire) == phase) {
    if (h->abort.load(std::memory_order_acquire) != 0) return false;
    if (std::chrono::steady_clock::now() > deadline) return false;
    futex(&h->phase, FUTEX_WAIT, phase, &slice);
  }
  return h->abort.load(std::memory_order_acquire) == 0;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

void shm_allreduce_init(at::Tensor segment, int64_t world, int64_t slot_floats, int64_t spins) {
  TORCH_CHECK(segment.scalar_type() == at::kByte && segment.is_contiguous(), "shm_allreduce: uint8 segment");
  TORCH_CHECK(segment.numel() >= kHeaderBytes + 2 * world * slot_floats * 4, "shm_allreduce: segment too small");
  std::memset(segment.data_ptr(), 0, kHeaderBytes);
  Header* h = header_of(segment);
  h->world = static_cast<uint32_t>(world);
  h->slot_floats = static_cast<uint64_t>(slot_floats);
  h->spins = static_cast<uint32_t>(spins);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
}

int64_t shm_allreduce_bytes(int64_t world, int64_t slot_floats) { return kHeaderBytes + 2 * world * slot_floats * 4; }

// Sum `x` (fp32 or bf16, contiguous, at most slot_floats elements) over the group's ranks, in place, in rank
// order and in fp32. `call` counts this rank's calls (every rank calls in the same order). False: the group
// aborted or a peer did not arrive within `timeout_s` (x is then unspecified).
bool shm_allreduce(at::Tensor x, const at::Tensor& segment, int64_t rank, int64_t call, double timeout_s) {
  Header* h = header_of(segment);
  TORCH_CHECK(h->magic == kMagic, "shm_allreduce: segment not initialised");
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "shm_allreduce: contiguous fp32 or bf16");
  const int64_t n = x.numel();
  TORCH_CHECK(n <= static_cast<int64_t>(h->slot_floats), "shm_allreduce: tensor larger than a slot");
  const int64_t parity = call & 1, world = h->world;
  float* mine = slot(segment, parity, rank);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t grain = 1 << 16;
  if (bf16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) mine[i] = bf16_to_float(src[i]);
    });
  } else {
    std::memcpy(mine, x.data_ptr<float>(), n * sizeof(float));
  }
  if (!barrier(h, timeout_s)) return false;
  const float* parts[64];
  TORCH_CHECK(world <= 64, "shm_allreduce: at most 64 ranks");
  for (int64_t r = 0; r < world; ++r) parts[r] = slot(segment, parity, r);
  void* out = x.data_ptr();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float sum = parts[0][i];
      for (int64_t r = 1; r < world; ++r) sum += parts[r][i];
      if (bf16) {
        static_cast<uint16_t*>(out)[i] = float_to_bf16(sum);
      } else {
        static_cast<float*>(out)[i] = sum;
      }
    }
  });
  return true;
}

// Make every current and future wait on the segment return false at once (the group failed).
void shm_allreduce_abort(const at::Tensor& segment) {
  Header* h = header_of(segment);
  h->abort.store(1, std::memory_order_release);
  h->phase.fetch_add(1, std::memory_order_release);
  futex(&h->phase, FUTEX_WAKE, INT_MAX, nullptr);
}

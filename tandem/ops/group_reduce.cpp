// The worker group's all-reduce from inside the native layer stack (layer_stack.cpp): the same
// shared-memory exchange as tandem/parallel/shm.py, byte for byte, so that a rank in the stack and
// a rank in the Python loop meet at the same exchanges. The file's layout (shm.py): a 4 KiB header
// of 64-bit words (rank r's counter at word 8r, its two slots' lengths at 8 * size + 2r + parity,
// its pid at 10 * size + r, the nanoseconds of its compiled all-reduces at 11 * size + r), then two
// slots of slot_bytes per rank. An exchange publishes this rank's
// bytes in slot (rank, seq & 1), stores its counter = seq (after the bytes; a release store), and
// waits until every counter has reached seq; the sum reads the slots in rank order, as shm.py's does.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>
#include <sched.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

namespace tandem_ops {

namespace {

constexpr int64_t kHeader = 4096;
constexpr int64_t kLineWords = 8;
constexpr double kTimeoutS = 600.0;  // parallel/comm.py's STEP_TIMEOUT_S
// Pauses before yielding the core: a balanced peer arrives within them; a rank sharing its core with
// its peer (more ranks than cores) must not spin long before letting it run.
constexpr int64_t kSpins = 2000;

bool process_alive(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return kill(static_cast<pid_t>(pid), 0) == 0;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return true;
  const char state = text[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

// base: the mapped file's address; returns the sum over ranks of t (a new tensor).
at::Tensor group_all_reduce(const at::Tensor& t, int64_t base, int64_t rank, int64_t size, int64_t slot_bytes) {
  const auto entered = std::chrono::steady_clock::now();
  const at::Tensor c = t.contiguous();
  const int64_t nbytes = c.numel() * c.element_size();
  TORCH_CHECK(nbytes <= slot_bytes, "group all-reduce: ", nbytes, " bytes exceed the slot of ", slot_bytes);
  auto* mem = reinterpret_cast<uint8_t*>(base);
  auto* words = reinterpret_cast<int64_t*>(mem);
  const int64_t seq = __atomic_load_n(&words[rank * kLineWords], __ATOMIC_RELAXED) + 1;
  const int64_t parity = seq & 1;
  auto slot = [&](int64_t r) { return mem + kHeader + (r * 2 + parity) * slot_bytes; };
  std::memcpy(slot(rank), c.data_ptr(), nbytes);
  words[size * kLineWords + 2 * rank + parity] = nbytes;
  __atomic_store_n(&words[rank * kLineWords], seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < size; ++r) {
    int64_t spins = 0;
    auto start = std::chrono::steady_clock::time_point();
    while (__atomic_load_n(&words[r * kLineWords], __ATOMIC_ACQUIRE) < seq) {
      if (++spins < kSpins) {
        _mm_pause();
        continue;
      }
      if (spins == kSpins) start = std::chrono::steady_clock::now();
      sched_yield();
      if (spins % 4096 == 0) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const int64_t pid = words[size * kLineWords + 2 * size + r];
        TORCH_CHECK(pid == 0 || process_alive(pid), "worker group: rank ", r, " (pid ", pid, ") died");
        TORCH_CHECK(waited < kTimeoutS, "worker group: rank ", r, " did not answer in ", kTimeoutS, " s");
      }
    }
  }
  auto part = [&](int64_t r) { return at::from_blob(slot(r), c.sizes(), c.options()); };
  at::Tensor out;
  if (size == 2) {
    out = at::add(part(0), part(1));
  } else {
    at::Tensor acc = part(0).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    for (int64_t r = 1; r < size; ++r) acc.add_(part(r));
    out = acc.to(c.scalar_type());
  }
  words[11 * size + rank] += std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - entered).count();
  return out;
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("group_all_reduce(Tensor t, int base, int rank, int size, int slot_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("group_all_reduce", &tandem_ops::group_all_reduce); }

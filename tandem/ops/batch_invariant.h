// Batch invariance: whether each row's result is independent of the batch it is computed in.
//
// When on (the default), a linear layer reduces every output over K in one fixed order whatever the
// row count (no switch to another micro-kernel past a few rows), and decode attention splits a long
// sequence into parts at fixed token positions whatever the batch and thread count. Then greedy
// output is the same alone or batched, streamed or not, cached or not, chunked or whole (vLLM's
// batch-invariant mode, SGLang's deterministic inference). Off restores the batch-dependent fast
// paths, for measuring what invariance costs (benchmarks/batch_invariance.py).
#pragma once

#include <atomic>

namespace tandem_ops {

inline std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool batch_invariant() { return batch_invariant_flag().load(std::memory_order_relaxed); }

}  // namespace tandem_ops

// Shared by the paged prefill attention kernels (paged_prefill.cpp: entry and AVX512 tiles;
// paged_prefill_brgemm.cpp: the brgemm path).
#pragma once

#include <cstdint>

namespace tandem_ops {

struct PrefillParams {
  const void* q;  // [T, H, D], token rows q_stride elements apart (heads packed within a row)
  const void* k;  // [num_blocks, BS, KVH, D]
  const void* v;
  void* out;  // [T, H, D]
  const int32_t* block_tables;
  const int32_t* query_start;  // [N + 1]
  const int32_t* seq_lens;     // [N], context + q_len
  int64_t max_blocks, bs, kvh, heads, group, d, q_stride;
  float scale;
  int64_t window;  // > 0: query at position p sees keys (p - window, p] only
  float softcap;   // > 0: scores become softcap * tanh(score / softcap)
};

// The brgemm path (bf16): usable for this head_dim on this CPU, and the kernel itself.
bool prefill_brgemm_usable(int64_t head_dim);
void run_prefill_brgemm(const PrefillParams& P, int64_t n_seqs);

}  // namespace tandem_ops

// Paged decode attention for CPU.
//
// One query token per sequence attends to all of that sequence's cached keys, which live in
// fixed-size blocks scattered through a pool (k_cache/v_cache: [num_blocks, block_size, KVH, D] in
// the query's dtype, or int8 rows [..., D + 4] whose last 4 bytes are the row's float32 scale: the
// scale multiplies a token's score, and its weight in p.V, once per row).
// Decode attention should be memory bound, so the design is about touching each K/V byte once and
// keeping the arithmetic per byte small enough that it stays memory bound:
//   * a work item is (sequence, range of kv heads[, range of blocks]); the query heads sharing a kv
//     head are processed together, so each K/V row is read once per group, not once per head; with
//     enough sequences an item takes all kv heads, so it reads whole contiguous token rows;
//   * online softmax over chunks of ~256 tokens: q.k for the chunk's blocks, one update of the
//     running max and sum per head, then p.V over the same blocks. One pass over K and V, with the
//     max/sum bookkeeping (horizontal reductions, exp of the rescale factor) amortized over a chunk;
//   * a software prefetcher runs two block-steps ahead in consumption order (K rows of a chunk's
//     blocks, then their V rows, then the next chunk), its lines spread over the work so they never
//     burst: blocks are scattered, and the hardware prefetcher cannot follow the block table;
//   * q.k scores for 16 tokens are reduced together (one transpose-and-add tree instead of 16
//     horizontal sums), and with AVX512-BF16 both q.k and p.V use dpbf16 (bf16 pairs, float
//     accumulation); p.V pairs up consecutive tokens, which leaves the accumulator lanes in a
//     permuted order that is undone once per item;
//   * with few sequences, kv heads and then block ranges are split so every thread has work;
//     partial (max, sum, accumulator) results of block ranges are merged afterwards;
//   * items are handed out longest-first from a shared counter, so uneven lengths balance.
// Without AVX512 a portable scalar path (auto-vectorizable) is compiled instead; float32 caches use
// float FMAs on AVX512. The TANDEM_* macros below are tuning knobs (-D...) for experiments.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "batch_invariant.h"
#include "decode_blocks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace tandem_ops {
namespace {

// Lower bound on a split part, in tokens: merging partials costs a little, so parts stay large.
constexpr int64_t kMinPartTokens = 256;
// Items per thread to aim for when deciding whether to split the work further.
constexpr int64_t kItemsPerThread = 4;

struct Item {
  int32_t seq;
  int32_t kvh;  // kv heads [kvh, kvh_end)
  int32_t kvh_end;
  int32_t blk_begin;  // blocks [blk_begin, blk_end) of the sequence
  int32_t blk_end;
  int32_t slot;  // row in the partial-result buffers, or -1 when the item covers the whole sequence
};

struct Params {
  const void* q;  // [N, H, D], token rows q_stride elements apart (heads packed within a row)
  const void* k;  // [num_blocks, BS, KVH, D]
  const void* v;
  void* out;  // [N, H, D]
  const int32_t* block_tables;
  const int32_t* seq_lens;
  int64_t max_blocks;
  int64_t bs;
  int64_t kvh;
  int64_t heads;
  int64_t group;
  int64_t d;
  int64_t q_stride;
  float scale;
  int64_t window;  // > 0: each query sees its last `window` keys only (sliding-window layers)
  float softcap;   // > 0: scores become softcap * tanh(score / softcap) before the softmax
  const float* sinks;  // [H] or null: each head's sink logit joins the softmax's denominator (gpt-oss)
  float* part_m;    // [slots, H]
  float* part_l;    // [slots, H]
  float* part_acc;  // [slots, H, D]
};

// The factor that turns a head's accumulator into its output: 1 / the softmax's denominator, where
// l sums exp(score - m) over the keys and a sink logit s (gpt-oss) adds exp(s - m) to it; written so
// that nothing overflows when the sink dwarfs every score. No keys (l == 0): zeros.
inline float output_scale(float m, float l, const float* sinks, int64_t h) {
  if (l <= 0.0f) return 0.0f;
  if (sinks == nullptr) return 1.0f / l;
  const float s = sinks[h];
  if (s > m) {
    const float a = std::exp(m - s);
    return a / (l * a + 1.0f);
  }
  return 1.0f / (l + std::exp(s - m));
}

// =============================================================================================
// Work items
// =============================================================================================

// DC is head_dim when known at compile time (common sizes), else 0 and P.d is used.
//
// The item's blocks are taken a chunk at a time: scores for every block of the chunk (K), one
// softmax update per head, then the weighted sum of V over the chunk. A prefetch cursor runs
// kPrefetchAhead steps ahead in exactly that consumption order (K blocks of a chunk, then its V
// blocks, then the next chunk's), one block's rows per step; blocks are scattered, so without it
// each block would start with a full memory-latency stall.
// T is the query's and output's type, KV the cache's: T itself, or int8 rows with their scales.
template <typename T, typename KV, int DC>
void run_item(const Params& P, const Item& it, Scratch<KV>& S) {
  const int64_t G = P.group, D = DC > 0 ? DC : P.d, BS = P.bs;
  const int64_t HS = head_stride<KV>(D);
  const int64_t row_stride = P.kvh * HS;  // one token's row: all kv heads side by side
  const int64_t block_stride = BS * row_stride;
  const int64_t n_kv = it.kvh_end - it.kvh;
  const int64_t h0 = static_cast<int64_t>(it.kvh) * G, nh = n_kv * G;  // query heads of the item
  const int64_t AS = S.acc_stride, SS = S.s_stride;
  const int64_t CB = chunk_blocks(BS);
  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.max_blocks;
  const int64_t len = P.seq_lens[it.seq];
  const int64_t lo = window_start(len, P.window);  // keys before it are outside the window
  const KV* kbase = static_cast<const KV*>(P.k) + it.kvh * HS;
  const KV* vbase = static_cast<const KV*>(P.v) + it.kvh * HS;

  const T* q = static_cast<const T*>(P.q) + static_cast<int64_t>(it.seq) * P.q_stride + h0 * D;
  for (int64_t i = 0; i < nh * D; ++i) S.q[i] = static_cast<typename QueryType<KV>::type>(q[i]);
  std::fill_n(S.acc.begin(), nh * AS, 0.0f);
  std::fill_n(S.m.begin(), nh, kNegInf);
  std::fill_n(S.l.begin(), nh, 0.0f);

  auto rows_in = [&](int64_t b) { return std::min<int64_t>(BS, len - b * BS); };
  // Consumption step s (K or V rows of one block) -> its region for the prefetcher.
  const int64_t n_steps = 2 * (it.blk_end - it.blk_begin);
  const int64_t row_bytes = n_kv * HS * static_cast<int64_t>(sizeof(KV));
  const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(KV));
  Prefetcher pf;
  // issue() calls per step: block_scores makes one per (kv head, kScoreLanes tokens, head); the V pass one
  // per (kv head, head chunk, 32 dims) (16 dims without the pair path; AVX2: per head and 64 dims).
  const int64_t k_calls = n_kv * ((BS + kScoreLanes - 1) / kScoreLanes) * G;
#if defined(TANDEM_AVX2)
  const int64_t v_calls = n_kv * G * ((D + 63) / 64);  // accumulate_v_avx2's: per head and 64 dims
#else
  const int64_t v_calls = n_kv * ((G + kHeadChunk - 1) / kHeadChunk) * ((D + 31) / 32) * (kPairV<KV> ? 1 : 2);
#endif
  // Queue step s's region, spread over `calls` issue() calls (those of the step now starting).
  auto prefetch_step = [&](int64_t s, int64_t calls) {
    if (s >= n_steps) return;
    const int64_t c0 = it.blk_begin + s / (2 * CB) * CB;
    const int64_t nb = std::min<int64_t>(CB, it.blk_end - c0);
    const int64_t r = s % (2 * CB);
    const int64_t b = c0 + (r < nb ? r : r - nb);
    pf.set((r < nb ? kbase : vbase) + bt[b] * block_stride, rows_in(b), stride_bytes, row_bytes, calls);
  };
  for (int64_t s = 0; s < kPrefetchAhead; ++s) prefetch_step(s, 1);
  pf.flush();
  int64_t step = 0;

  for (int64_t c0 = it.blk_begin; c0 < it.blk_end; c0 += CB) {
    const int64_t c1 = std::min<int64_t>(it.blk_end, c0 + CB);
    const int64_t ntok = std::min<int64_t>(len, c1 * BS) - c0 * BS;

    // q.k for every block of the chunk; scores of head h at S.scores[h * SS + token in chunk].
    for (int64_t b = c0, off = 0; b < c1; ++b, ++step) {
      prefetch_step(step + kPrefetchAhead, k_calls);
      const int64_t n = rows_in(b);
      const KV* kb = kbase + bt[b] * block_stride;
      for (int64_t j = 0; j < n_kv; ++j)
        block_scores(S.q.data() + j * G * D, G, kb + j * HS, row_stride, n, D, P.scale,
                     S.scores.data() + j * G * SS + off, SS, pf);
      off += n;
    }
    // Only a sequence's first chunk can straddle the window's start (items begin at its block).
    const int64_t hidden = std::min(ntok, lo - c0 * BS);
    if (P.softcap > 0.0f || hidden > 0)
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = S.scores.data() + h * SS;
        if (P.softcap > 0.0f) soft_cap_scores(sh, ntok, P.softcap);
        if (hidden > 0) std::fill_n(sh, hidden, kNegInf);
      }

    for (int64_t h = 0; h < nh; ++h) {
      const float alpha = softmax_update(S.scores.data() + h * SS, ntok, S.m[h], S.l[h]);
      if (alpha != 1.0f)
        for (int64_t i = 0; i < AS; ++i) S.acc[h * AS + i] *= alpha;
      if constexpr (kPairV<KV>) weights_to_bf16(S.scores.data() + h * SS, S.pb.data() + h * SS, ntok);
    }

    for (int64_t b = c0, off = 0; b < c1; ++b, ++step) {
      prefetch_step(step + kPrefetchAhead, v_calls);
      const int64_t n = rows_in(b);
      const KV* vb = vbase + bt[b] * block_stride;
      for (int64_t j = 0; j < n_kv; ++j)
        block_accumulate(S.acc.data() + j * G * AS, AS, S.scores.data() + j * G * SS + off,
                         S.pb.data() + j * G * SS + off, SS, vb + j * HS, n, row_stride, G, D, pf);
      off += n;
    }
  }

#if defined(TANDEM_DPBF16)
  if constexpr (kPairV<KV>)
    for (int64_t h = 0; h < nh; ++h) unpermute_acc(S.acc.data() + h * AS, D);
#endif
  if (it.slot < 0) {
    T* out = static_cast<T*>(P.out) + (static_cast<int64_t>(it.seq) * P.heads + h0) * D;
    for (int64_t h = 0; h < nh; ++h) {
      const float inv = output_scale(S.m[h], S.l[h], P.sinks, h0 + h);
      for (int64_t i = 0; i < D; ++i) out[h * D + i] = static_cast<T>(S.acc[h * AS + i] * inv);
    }
  } else {
    // Partial rows are laid out [slot, H, ...]; the item fills only its own heads.
    const int64_t row0 = static_cast<int64_t>(it.slot) * P.heads + h0;
    std::copy_n(S.m.begin(), nh, P.part_m + row0);
    std::copy_n(S.l.begin(), nh, P.part_l + row0);
    for (int64_t h = 0; h < nh; ++h) std::copy_n(S.acc.begin() + h * AS, D, P.part_acc + (row0 + h) * D);
  }
}

struct Split {
  int32_t seq, h0, h1, slot0, count;  // query heads [h0, h1) of seq, partials in slots [slot0, +count)
};

// Merge the partial (max, sum, accumulator) triples of a split sequence into the output.
template <typename T>
void merge_parts(const Params& P, const Split& sp) {
  const int64_t D = P.d;
  std::vector<float> acc(D);
  for (int64_t h = sp.h0; h < sp.h1; ++h) {
    float m = kNegInf;
    for (int64_t s = sp.slot0; s < sp.slot0 + sp.count; ++s) m = std::max(m, P.part_m[s * P.heads + h]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = sp.slot0; s < sp.slot0 + sp.count; ++s) {
      const int64_t row = s * P.heads + h;
      if (P.part_l[row] == 0.0f) continue;
      const float w = std::exp(P.part_m[row] - m);
      l += P.part_l[row] * w;
      const float* a = P.part_acc + row * D;
      for (int64_t i = 0; i < D; ++i) acc[i] += a[i] * w;
    }
    const float inv = output_scale(m, l, P.sinks, h);
    T* out = static_cast<T*>(P.out) + (static_cast<int64_t>(sp.seq) * P.heads + h) * D;
    for (int64_t i = 0; i < D; ++i) out[i] = static_cast<T>(acc[i] * inv);
  }
}

template <typename T, typename KV>
void run(Params& P, int64_t n_seqs, int64_t num_blocks) {
  const int64_t BS = P.bs, KVH = P.kvh, G = P.group;
  const int64_t nthreads = std::max(1, at::get_num_threads());

  // Validate the block tables on the host (cheap next to the attention itself) so a bad entry
  // raises instead of reading outside the pool.
  int64_t total_blocks = 0;
  std::vector<int64_t> nblocks(n_seqs), first(n_seqs);  // first: the block holding the window's first key
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t len = P.seq_lens[s];
    TORCH_CHECK(len >= 0, "paged_decode_attention: negative seq_len");
    nblocks[s] = (len + BS - 1) / BS;
    TORCH_CHECK(nblocks[s] <= P.max_blocks, "paged_decode_attention: seq_len ", len,
                " needs more blocks than block_tables has columns (", P.max_blocks, ")");
    const int32_t* bt = P.block_tables + s * P.max_blocks;
    for (int64_t b = 0; b < nblocks[s]; ++b)
      TORCH_CHECK(bt[b] >= 0 && bt[b] < num_blocks, "paged_decode_attention: block id ", bt[b],
                  " out of range [0, ", num_blocks, ")");
    first[s] = window_start(len, P.window) / BS;
    total_blocks += nblocks[s] - first[s];
  }

  // Work decomposition. An item reads whole token rows (all kv heads, contiguous in memory) when
  // there are enough sequences to go round; with few sequences the kv heads are split, then long
  // sequences are split into block ranges, so every thread has work.
  const int64_t target = nthreads > 1 ? nthreads * kItemsPerThread : 1;
  const int64_t head_chunks = std::min(KVH, (target + n_seqs - 1) / n_seqs);
  const int64_t kv_per_chunk = (KVH + head_chunks - 1) / head_chunks;
  int64_t part_blocks = std::numeric_limits<int32_t>::max();
  const int64_t min_part = std::max<int64_t>(1, (kMinPartTokens + BS - 1) / BS);
  if (batch_invariant()) {
    // Parts at fixed positions, merged in order, whatever the batch and the threads: a sequence's
    // sums are the same in any step (a part is one chunk of the online softmax).
    part_blocks = std::max<int64_t>(1, chunk_blocks(BS));
  } else if (nthreads > 1) {
    part_blocks = std::max(min_part, (total_blocks * head_chunks + target - 1) / target);
  }

  std::vector<Item> items;
  std::vector<Split> splits;
  int32_t slots = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    if (nblocks[s] == 0) {  // nothing to attend to: define the output as zeros
      T* out = static_cast<T*>(P.out) + s * P.heads * P.d;
      std::fill(out, out + P.heads * P.d, static_cast<T>(0.0f));
      continue;
    }
    const int64_t span = nblocks[s] - first[s];
    const int64_t parts = (span + part_blocks - 1) / part_blocks;
    const int32_t seq = static_cast<int32_t>(s);
    for (int64_t k0 = 0; k0 < KVH; k0 += kv_per_chunk) {
      const int32_t k1 = static_cast<int32_t>(std::min(KVH, k0 + kv_per_chunk));
      if (parts == 1) {
        items.push_back({seq, static_cast<int32_t>(k0), k1, static_cast<int32_t>(first[s]),
                         static_cast<int32_t>(nblocks[s]), -1});
        continue;
      }
      // Slots hold all H heads, so the head chunks of one sequence share the same slots.
      splits.push_back({seq, static_cast<int32_t>(k0 * G), static_cast<int32_t>(k1 * G), slots,
                        static_cast<int32_t>(parts)});
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t b0 = first[s] + p * part_blocks, b1 = std::min(nblocks[s], b0 + part_blocks);
        items.push_back({seq, static_cast<int32_t>(k0), k1, static_cast<int32_t>(b0), static_cast<int32_t>(b1),
                         slots + static_cast<int32_t>(p)});
      }
    }
    if (parts > 1) slots += static_cast<int32_t>(parts);
  }
  // Longest first: with dynamic hand-out this keeps the threads finishing together.
  auto work = [](const Item& a) { return (a.blk_end - a.blk_begin) * (a.kvh_end - a.kvh); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return work(a) > work(b); });

  std::vector<float> part_m, part_l, part_acc;
  if (slots > 0) {
    part_m.resize(static_cast<size_t>(slots) * P.heads);
    part_l.resize(static_cast<size_t>(slots) * P.heads);
    part_acc.resize(static_cast<size_t>(slots) * P.heads * P.d);
    P.part_m = part_m.data();
    P.part_l = part_l.data();
    P.part_acc = part_acc.data();
  }

  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(nthreads, n_items);
  auto item_fn = P.d == 64 ? &run_item<T, KV, 64> : P.d == 128 ? &run_item<T, KV, 128> : &run_item<T, KV, 0>;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<KV> scratch(kv_per_chunk * G, P.d, chunk_blocks(BS) * BS);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item_fn(P, items[i], scratch);
  });
  if (!splits.empty()) {
    at::parallel_for(0, static_cast<int64_t>(splits.size()), 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) merge_parts<T>(P, splits[i]);
    });
  }
}

}  // namespace

// Writes into `out` ([N, H, D], contiguous, q's dtype), e.g. the decode rows of a step's output.
// q may be a strided view (token rows of a fused qkv projection) as long as each row's heads are packed.
at::Tensor& paged_decode_attention_out(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                                       at::Tensor& out) {
  TORCH_CHECK(q_in.dim() == 3, "paged_decode_attention: q must be [N, H, D]");
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == q_in.size(1),
                "paged_decode_attention: sinks must be contiguous float32 [H]");
  const int64_t N = q_in.size(0);
  check_attention_inputs(q_in, k_cache, v_cache, block_tables, N, out, "paged_decode_attention",
                         /*int8_rows_ok=*/true);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == N,
              "paged_decode_attention: seq_lens must be int32 [N]");
  if (N == 0) return out;

  const at::Tensor q = packed_rows(q_in);
  const at::Tensor bt = block_tables.contiguous();
  const at::Tensor sl = seq_lens.contiguous();
  Params P{};
  fill_common_params(P, q, out, k_cache, v_cache, bt, sl, scale, window, softcap);
  P.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;

  const bool int8_rows = k_cache.scalar_type() == at::kChar;
  if (q.scalar_type() == at::kFloat) {
    int8_rows ? run<float, int8_t>(P, N, k_cache.size(0)) : run<float, float>(P, N, k_cache.size(0));
  } else if (q.scalar_type() == at::kBFloat16) {
    int8_rows ? run<bf16, int8_t>(P, N, k_cache.size(0)) : run<bf16, bf16>(P, N, k_cache.size(0));
  } else {
    TORCH_CHECK(false, "paged_decode_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  }
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, H, D]");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  return paged_decode_attention_out(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks, out);
}

// Which code path was compiled in (shown by the build script and the benchmark).
std::string isa() {
#if defined(TANDEM_DPBF16)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512f";
#elif defined(TANDEM_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_decode_attention.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window=0, float softcap=0.0, Tensor? sinks=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("isa", &tandem_ops::isa);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_decode_attention", &tandem_ops::paged_decode_attention);
  m.impl("paged_decode_attention.out", &tandem_ops::paged_decode_attention_out);
}

// Paged prefill attention for CPU: variable-length, causal, straight from the KV pool.
//
// Each sequence brings q_len new query tokens (a whole prompt, a chunk of one, or a few
// speculative tokens) that follow its cached context; their K/V are already written into the
// pool. Query i of a sequence sits at position context + i and attends keys [0, context + i]
// (causal, aligned to the bottom right). There is no padding to the longest sequence, no gather
// of the context into a dense copy and no mask tensor: keys are read in place through the block
// table, and the causal limit is applied to the scores of the blocks that cross the diagonal.
//
// Unlike decode this is compute-bound, so the design is about reuse: a work item is (sequence,
// kv head, tile of up to kQueryTile queries), and the tile's queries times the query heads that
// share the kv head form one set of rows that every K/V row of the block is used for while it is
// in L1. The per-block steps (q.k scores, online softmax over chunks, p.V with dpbf16) are the
// decode kernel's (attention_blocks.h). Items are handed out longest-first from a shared counter.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_blocks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem_ops {
namespace {

// Queries per work item: tile rows = kQueryTile * group; scores of a chunk for all rows stay in L2.
constexpr int64_t kQueryTile = 16;

struct PrefillItem {
  int32_t seq;
  int32_t kvh;
  int32_t q0, q1;  // queries [q0, q1) of the sequence
};

struct PrefillParams {
  const void* q;  // [T, H, D]
  const void* k;  // [num_blocks, BS, KVH, D]
  const void* v;
  void* out;  // [T, H, D]
  const int32_t* block_tables;
  const int32_t* query_start;  // [N + 1]
  const int32_t* seq_lens;     // [N], context + q_len
  int64_t max_blocks, bs, kvh, heads, group, d;
  float scale;
};

template <typename T, int DC>
void run_prefill_item(const PrefillParams& P, const PrefillItem& it, Scratch<T>& S) {
  const int64_t G = P.group, D = DC > 0 ? DC : P.d, BS = P.bs;
  const int64_t row_stride = P.kvh * D, block_stride = BS * row_stride;
  const int64_t AS = S.acc_stride, SS = S.s_stride, CB = chunk_blocks(BS);
  const int64_t qs = P.query_start[it.seq], q_len = P.query_start[it.seq + 1] - qs;
  const int64_t context = P.seq_lens[it.seq] - q_len;
  const int64_t first_pos = context + it.q0;          // position of the tile's first query
  const int64_t n_keys = context + it.q1;             // the last query sees keys [0, n_keys)
  const int64_t rows = (it.q1 - it.q0) * G;           // row r: query q0 + r / G, head kvh * G + r % G
  const int64_t n_blocks = (n_keys + BS - 1) / BS;
  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.max_blocks;
  const T* kbase = static_cast<const T*>(P.k) + it.kvh * D;
  const T* vbase = static_cast<const T*>(P.v) + it.kvh * D;

  for (int64_t i = it.q0; i < it.q1; ++i) {
    const T* src = static_cast<const T*>(P.q) + ((qs + i) * P.heads + it.kvh * G) * D;
    auto* dst = S.q.data() + (i - it.q0) * G * D;
    for (int64_t j = 0; j < G * D; ++j) dst[j] = static_cast<typename QueryType<T>::type>(src[j]);
  }
  std::fill_n(S.acc.begin(), rows * AS, 0.0f);
  std::fill_n(S.m.begin(), rows, kNegInf);
  std::fill_n(S.l.begin(), rows, 0.0f);
  Prefetcher pf;  // idle: the keys of a compute-bound tile are reused from cache

  for (int64_t c0 = 0; c0 < n_blocks; c0 += CB) {
    const int64_t c1 = std::min(n_blocks, c0 + CB);
    const int64_t key0 = c0 * BS, ntok = std::min(n_keys, c1 * BS) - key0;
    for (int64_t b = c0, off = 0; b < c1; ++b) {
      const int64_t n = std::min(BS, n_keys - b * BS);
      block_scores(S.q.data(), rows, kbase + bt[b] * block_stride, row_stride, n, D, P.scale, S.scores.data() + off,
                   SS, pf);
      off += n;
    }
    if (key0 + ntok - 1 > first_pos) {  // the chunk crosses the diagonal: hide each row's future keys
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::clamp<int64_t>(first_pos + r / G + 1 - key0, 0, ntok);  // keys row r sees
        std::fill(S.scores.data() + r * SS + visible, S.scores.data() + r * SS + ntok, kNegInf);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float alpha = softmax_update(S.scores.data() + r * SS, ntok, S.m[r], S.l[r]);
      if (alpha != 1.0f)
        for (int64_t i = 0; i < AS; ++i) S.acc[r * AS + i] *= alpha;
      if constexpr (kPairV<T>) weights_to_bf16(S.scores.data() + r * SS, S.pb.data() + r * SS, ntok);
    }
    for (int64_t b = c0, off = 0; b < c1; ++b) {
      const int64_t n = std::min(BS, n_keys - b * BS);
      block_accumulate(S.acc.data(), AS, S.scores.data() + off, S.pb.data() + off, SS, vbase + bt[b] * block_stride,
                       n, row_stride, rows, D, pf);
      off += n;
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX512BF16__)
    if constexpr (kPairV<T>) unpermute_acc(S.acc.data() + r * AS, D);
#endif
    T* dst = static_cast<T*>(P.out) + ((qs + it.q0 + r / G) * P.heads + it.kvh * G + r % G) * D;
    const float inv = S.l[r] > 0.0f ? 1.0f / S.l[r] : 0.0f;
    for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(S.acc[r * AS + i] * inv);
  }
}

// Checks the host-side metadata (cheap next to the attention) so a bad entry raises instead of
// reading outside the pool.
void validate(const PrefillParams& P, int64_t n_seqs, int64_t num_blocks) {
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t q_len = P.query_start[s + 1] - P.query_start[s], len = P.seq_lens[s];
    TORCH_CHECK(q_len >= 0 && q_len <= len, "paged_prefill_attention: sequence ", s, " has ", q_len,
                " queries but seq_len ", len);
    const int64_t nb = (len + P.bs - 1) / P.bs;
    TORCH_CHECK(nb <= P.max_blocks, "paged_prefill_attention: seq_len ", len,
                " needs more blocks than block_tables has columns (", P.max_blocks, ")");
    const int32_t* bt = P.block_tables + s * P.max_blocks;
    for (int64_t b = 0; b < nb; ++b)
      TORCH_CHECK(bt[b] >= 0 && bt[b] < num_blocks, "paged_prefill_attention: block id ", bt[b],
                  " out of range [0, ", num_blocks, ")");
  }
}

template <typename T>
void run_prefill(const PrefillParams& P, int64_t n_seqs, int64_t num_blocks) {
  validate(P, n_seqs, num_blocks);
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t q_len = P.query_start[s + 1] - P.query_start[s];
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryTile)
      for (int64_t h = 0; h < P.kvh; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(q0),
                         static_cast<int32_t>(std::min(q_len, q0 + kQueryTile))});
  }
  // Longest first (work ~ queries x keys seen), so the threads finish together.
  auto work = [&](const PrefillItem& a) {
    const int64_t context = P.seq_lens[a.seq] - (P.query_start[a.seq + 1] - P.query_start[a.seq]);
    return static_cast<int64_t>(a.q1 - a.q0) * (context + a.q1);
  };
  std::stable_sort(items.begin(), items.end(), [&](const PrefillItem& a, const PrefillItem& b) { return work(a) > work(b); });

  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), n_items);
  auto item_fn = P.d == 64 ? &run_prefill_item<T, 64> : P.d == 128 ? &run_prefill_item<T, 128> : &run_prefill_item<T, 0>;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<T> scratch(kQueryTile * P.group, P.d, chunk_blocks(P.bs) * P.bs);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item_fn(P, items[i], scratch);
  });
}


#if defined(__AVX512BF16__)
// =============================================================================================
// bf16 with AVX512-BF16: 16 query rows per vector
// =============================================================================================
// The generic item above computes q.k one row at a time and reduces across lanes. Here the lanes
// are 16 query rows instead: q is transposed once per item into d-pairs x 16 rows, so q.k for one
// key is D/2 dpbf16 with the key's d-pair broadcast straight from the pool (no transpose of K, no
// horizontal sums), the online softmax is elementwise over keys (max, exp and sums per lane), and
// p.V accumulates the transposed output [D][16 rows] with the weights of two keys per dpbf16 and
// the values' matching pair broadcast. Work per (row, key) is ~4 dpbf16 and as many loads.

constexpr int64_t kKeyChunk = 128;  // keys per online-softmax update

// A 32-bit pair broadcast from memory: a load-port-only broadcast (set1 of a loaded value would go
// through a general register and the shuffle port, which the dpbf16 stream then waits on).
TANDEM_INLINE __m512bh bcast_pair(const uint32_t* p) {
  return (__m512bh)_mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(p))));
}
constexpr int64_t kKeyGroup = 8;    // keys whose scores are accumulated at once (independent chains)

struct TileItem {
  int32_t seq, kvh;
  int32_t r0, nr;  // rows [r0, r0 + nr) of the sequence's (query, head-in-group) rows, nr <= 16
};

struct TileScratch {
  std::vector<uint32_t> qv;  // [D/2][16]: the rows' query d-pairs, transposed
  std::vector<float> st;     // [kKeyChunk][16]: a chunk's scores, then weights
  std::vector<uint32_t> pp;  // [kKeyChunk/2][16]: weights of key pairs as bf16 pairs
  std::vector<uint32_t> vv;  // [kKeyChunk/2][D]: values of key pairs as bf16 pairs
  std::vector<float> o;      // [D][16]: output accumulators, transposed
  explicit TileScratch(int64_t d)
      : qv(d / 2 * 16), st(kKeyChunk * 16), pp(kKeyChunk / 2 * 16), vv(kKeyChunk / 2 * d), o(d * 16) {}
};

template <int DC>
void run_tile_bf16(const PrefillParams& P, const TileItem& it, TileScratch& S) {
  const int64_t G = P.group, D = DC > 0 ? DC : P.d, BS = P.bs, DP = D / 2;
  const int64_t row_stride = P.kvh * D, block_stride = BS * row_stride;
  const int64_t qs = P.query_start[it.seq], q_len = P.query_start[it.seq + 1] - qs;
  const int64_t context = P.seq_lens[it.seq] - q_len;
  const int64_t first_pos = context + it.r0 / G, n_keys = context + (it.r0 + it.nr - 1) / G + 1;
  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.max_blocks;
  const bf16* kbase = static_cast<const bf16*>(P.k) + it.kvh * D;
  const bf16* vbase = static_cast<const bf16*>(P.v) + it.kvh * D;
  auto key_row = [&](const bf16* base, int64_t t) { return base + bt[t / BS] * block_stride + (t % BS) * row_stride; };

  alignas(64) int32_t pos[16];
  std::fill(S.qv.begin(), S.qv.end(), 0u);
  for (int64_t r = 0; r < 16; ++r) {
    const int64_t row = it.r0 + std::min<int64_t>(r, it.nr - 1);  // padding lanes repeat the last row's position
    pos[r] = static_cast<int32_t>(context + row / G);
    if (r >= it.nr) continue;
    const auto* src = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(P.q) +
                                                        ((qs + row / G) * P.heads + it.kvh * G + row % G) * D);
    for (int64_t dp = 0; dp < DP; ++dp) S.qv[dp * 16 + r] = src[dp];
  }
  const __m512i posv = _mm512_loadu_si512(pos);
  const __m512 scale = _mm512_set1_ps(P.scale), neg_inf = _mm512_set1_ps(kNegInf);
  // Interleave two 16-wide bf16 halves into pairs; and two 32-wide rows into pairs (lo, hi halves).
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  std::fill(S.o.begin(), S.o.begin() + D * 16, 0.0f);

  for (int64_t key0 = 0; key0 < n_keys; key0 += kKeyChunk) {
    const int64_t nt = std::min(kKeyChunk, n_keys - key0);
    // q.k: scores of 16 rows per key, kKeyGroup keys at a time.
    for (int64_t j0 = 0; j0 < nt; j0 += kKeyGroup) {
      const uint32_t* kp[kKeyGroup];
      for (int64_t j = 0; j < kKeyGroup; ++j)  // past the chunk: any valid row, never stored
        kp[j] = reinterpret_cast<const uint32_t*>(key_row(kbase, key0 + std::min(j0 + j, nt - 1)));
      __m512 acc[kKeyGroup];
      for (int64_t j = 0; j < kKeyGroup; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int64_t dp = 0; dp < DP; ++dp) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(S.qv.data() + dp * 16);
        for (int64_t j = 0; j < kKeyGroup; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], qd, bcast_pair(kp[j] + dp));
      }
      for (int64_t j = 0; j < kKeyGroup && j0 + j < nt; ++j) {
        const int64_t t = key0 + j0 + j;
        __m512 sc = _mm512_mul_ps(acc[j], scale);
        if (t > first_pos) sc = _mm512_mask_mov_ps(sc, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(t), posv), neg_inf);
        _mm512_storeu_ps(S.st.data() + (j0 + j) * 16, sc);
      }
    }
    // Online softmax, elementwise over the 16 rows.
    __m512 cmax = neg_inf;
    for (int64_t t = 0; t < nt; ++t) cmax = _mm512_max_ps(cmax, _mm512_loadu_ps(S.st.data() + t * 16));
    const __m512 m_new = _mm512_max_ps(m, cmax);  // finite: key 0 is visible to every row
    const __m512 alpha = exp512(_mm512_sub_ps(m, m_new));  // m = -inf on the first chunk: the state is zero
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {
      const __m512 sv = _mm512_loadu_ps(S.st.data() + t * 16);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(sv, m_new)));
      _mm512_storeu_ps(S.st.data() + t * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = m_new;
    for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(S.o.data() + d * 16, _mm512_mul_ps(_mm512_loadu_ps(S.o.data() + d * 16), alpha));
    // Weights and values of key pairs (t, t + 1) as bf16 pairs; an odd last key pairs with zeros.
    const int64_t npairs = (nt + 1) / 2;
    for (int64_t tp = 0; tp < npairs; ++tp) {
      const bool odd = 2 * tp + 1 == nt;
      const __m512 a = _mm512_loadu_ps(S.st.data() + 2 * tp * 16);
      const __m512 b = odd ? _mm512_setzero_ps() : _mm512_loadu_ps(S.st.data() + (2 * tp + 1) * 16);
      _mm512_storeu_si512(S.pp.data() + tp * 16, _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
      const bf16* v0 = key_row(vbase, key0 + 2 * tp);
      const bf16* v1 = odd ? nullptr : key_row(vbase, key0 + 2 * tp + 1);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x0 = _mm512_loadu_si512(v0 + d);
        const __m512i x1 = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(v1 + d);
        _mm512_storeu_si512(S.vv.data() + tp * D + d, _mm512_permutex2var_epi16(x0, lo_idx, x1));
        _mm512_storeu_si512(S.vv.data() + tp * D + d + 16, _mm512_permutex2var_epi16(x0, hi_idx, x1));
      }
    }
    // p.V into the transposed output, 16 dims at a time.
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_loadu_ps(S.o.data() + (d0 + i) * 16);
      for (int64_t tp = 0; tp < npairs; ++tp) {
        const __m512bh pw = (__m512bh)_mm512_loadu_si512(S.pp.data() + tp * 16);
        const uint32_t* vp = S.vv.data() + tp * D + d0;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], pw, bcast_pair(vp + i));
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(S.o.data() + (d0 + i) * 16, acc[i]);
    }
  }

  alignas(64) float inv[16];
  _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r;
    bf16* dst = static_cast<bf16*>(P.out) + ((qs + row / G) * P.heads + it.kvh * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<bf16>(S.o[d * 16 + r] * inv[r]);
  }
}

void run_prefill_tiles_bf16(const PrefillParams& P, int64_t n_seqs) {
  std::vector<TileItem> items;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t rows = (P.query_start[s + 1] - P.query_start[s]) * P.group;
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t h = 0; h < P.kvh; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(r0),
                         static_cast<int32_t>(std::min<int64_t>(16, rows - r0))});
  }
  auto work = [&](const TileItem& a) {  // keys seen by the tile's last row
    const int64_t context = P.seq_lens[a.seq] - (P.query_start[a.seq + 1] - P.query_start[a.seq]);
    return context + (a.r0 + a.nr - 1) / P.group;
  };
  std::stable_sort(items.begin(), items.end(), [&](const TileItem& a, const TileItem& b) { return work(a) > work(b); });
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), n_items);
  auto item_fn = P.d == 64 ? &run_tile_bf16<64> : P.d == 128 ? &run_tile_bf16<128> : &run_tile_bf16<0>;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch scratch(P.d);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item_fn(P, items[i], scratch);
  });
}
#endif  // __AVX512BF16__

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start,
                                   const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_prefill_attention: CPU tensors expected");
  TORCH_CHECK(q_in.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache must both be [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache must be contiguous");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start and seq_lens must be int32");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2), KVH = k_cache.size(2);
  const int64_t N = seq_lens.size(0);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D > 0, "head_dim must match and be a multiple of 16");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num heads must be a multiple of num kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == N, "block_tables must be [N, max_blocks]");
  TORCH_CHECK(query_start.dim() == 1 && query_start.size(0) == N + 1, "query_start must be [N + 1]");

  const at::Tensor q = q_in.contiguous(), bt = block_tables.contiguous(), qsl = query_start.contiguous();
  const at::Tensor sl = seq_lens.contiguous();
  TORCH_CHECK(qsl.data_ptr<int32_t>()[0] == 0 && qsl.data_ptr<int32_t>()[N] == T,
              "query_start must run from 0 to the number of query tokens");
  at::Tensor out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;

  PrefillParams P{};
  P.q = q.data_ptr();
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.block_tables = bt.data_ptr<int32_t>();
  P.query_start = qsl.data_ptr<int32_t>();
  P.seq_lens = sl.data_ptr<int32_t>();
  P.max_blocks = bt.size(1);
  P.bs = k_cache.size(1);
  P.kvh = KVH;
  P.heads = H;
  P.group = H / KVH;
  P.d = D;
  P.scale = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run_prefill<float>(P, N, k_cache.size(0));
  } else if (q.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    if (D % 32 == 0) {
      validate(P, N, k_cache.size(0));
      run_prefill_tiles_bf16(P, N);
      return out;
    }
#endif
    run_prefill<bf16>(P, N, k_cache.size(0));
  } else {
    TORCH_CHECK(false, "paged_prefill_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
      "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("paged_prefill_attention", &tandem_ops::paged_prefill_attention); }

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
// kv head, R query rows), a row being one query and one of the query heads that share the kv
// head, and every K/V element the item reads is used for all R rows at once (one vector: R is 16
// with AVX512, 8 with AVX2 + FMA). Items are handed out longest-first from a shared counter. A
// build with neither leaves prefill to the caller's PyTorch fallback (see prefill_kernel_supports).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_common.h"
#include "batch_invariant.h"
#include "paged_prefill.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace tandem_ops {
namespace {

constexpr int64_t kFewQueryRows = 48;  // query rows (queries x heads per kv head) a few tiles serve best

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

#if defined(__AVX512F__) || defined(TANDEM_AVX2)
// =============================================================================================
// Tiles of R query rows, R the vector's lanes (16 with AVX512, 8 with AVX2 + FMA)
// =============================================================================================
constexpr int64_t kKeyChunk = 64;  // keys per online-softmax update
constexpr int64_t kKeyGroup = 8;   // keys whose scores are accumulated at once (independent chains)

struct TileItem {
  int32_t seq, kvh;
  int32_t r0, nr;  // rows [r0, r0 + nr) of the sequence's (query, head-in-group) rows, nr <= R
};

template <int64_t R>
struct TileScratch {
  std::vector<float> qf;  // [D][R]: the rows' queries, transposed
  std::vector<float> kf;  // [kKeyGroup][D]: keys being scored, widened
  std::vector<float> st;  // [kKeyChunk][R]: a chunk's scores, then weights
  std::vector<float> vf;  // [kKeyChunk][D]: the chunk's values, widened
  std::vector<float> o;   // [D][R]: output accumulators, transposed
  explicit TileScratch(int64_t d) : qf(d * R), kf(kKeyGroup * d), st(kKeyChunk * R), vf(kKeyChunk * d), o(d * R) {}
};

// Every (sequence, kv head, R rows) item, handed out longest-first from a shared counter to
// tile(P, item, scratch), the ISA's tile for the head dim.
template <int64_t R, typename Tile>
void run_tiles(const PrefillParams& P, int64_t n_seqs, Tile tile) {
  std::vector<TileItem> items;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t rows = (P.query_start[s + 1] - P.query_start[s]) * P.group;
    for (int64_t r0 = 0; r0 < rows; r0 += R)
      for (int64_t h = 0; h < P.kvh; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(r0),
                         static_cast<int32_t>(std::min<int64_t>(R, rows - r0))});
  }
  auto work = [&](const TileItem& a) {  // keys seen by the tile's last row
    const int64_t context = P.seq_lens[a.seq] - (P.query_start[a.seq + 1] - P.query_start[a.seq]);
    const int64_t last = context + (a.r0 + a.nr - 1) / P.group;
    return P.window > 0 ? std::min<int64_t>(last, P.window + R) : last;
  };
  std::stable_sort(items.begin(), items.end(), [&](const TileItem& a, const TileItem& b) { return work(a) > work(b); });
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), n_items);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch<R> scratch(P.d);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      tile(P, items[i], scratch);
  });
}
#endif

#if defined(__AVX512F__)
// =============================================================================================
// AVX512: 16 query rows per vector
// =============================================================================================
// The generic item above computes q.k one row at a time and reduces across lanes. Here the lanes
// are 16 query rows instead: q is transposed once per item into [D][16 rows], so q.k for one key
// is D FMAs with the key's elements broadcast from memory (no horizontal sums), the online softmax
// is elementwise over keys (max, exp and sums per lane), and p.V accumulates the transposed output
// [D][16 rows] with each value element broadcast. The math is float32 FMA whatever the storage: these
// tiles serve float32, and bf16 only where the CPU lacks AVX512-BF16 (bf16 otherwise takes the brgemm
// path). Keys and values are widened once per item and chunk, into buffers that stay in L1.

template <typename T>
TANDEM_INLINE void widen_row(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
}

template <typename T, int DC>
void run_tile(const PrefillParams& P, const TileItem& it, TileScratch<16>& S) {
  const int64_t G = P.group, D = DC > 0 ? DC : P.d, BS = P.bs;
  const int64_t row_stride = P.kvh * D, block_stride = BS * row_stride;
  const int64_t qs = P.query_start[it.seq], q_len = P.query_start[it.seq + 1] - qs;
  const int64_t context = P.seq_lens[it.seq] - q_len;
  const int64_t first_pos = context + it.r0 / G, n_keys = context + (it.r0 + it.nr - 1) / G + 1;
  // With a window, keys before the first row's window are nobody's; later rows mask their own.
  const int64_t lo_key = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.max_blocks;
  const T* kbase = static_cast<const T*>(P.k) + it.kvh * D;
  const T* vbase = static_cast<const T*>(P.v) + it.kvh * D;
  auto key_row = [&](const T* base, int64_t t) { return base + bt[t / BS] * block_stride + (t % BS) * row_stride; };

  alignas(64) int32_t pos[16];
  std::fill(S.qf.begin(), S.qf.end(), 0.0f);
  for (int64_t r = 0; r < 16; ++r) {
    const int64_t row = it.r0 + std::min<int64_t>(r, it.nr - 1);  // padding lanes repeat the last row's position
    pos[r] = static_cast<int32_t>(context + row / G);
    if (r >= it.nr) continue;
    const T* src = static_cast<const T*>(P.q) + (qs + row / G) * P.q_stride + (it.kvh * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) S.qf[d * 16 + r] = static_cast<float>(src[d]);
  }
  const __m512i posv = _mm512_loadu_si512(pos);
  const __m512 scale = _mm512_set1_ps(P.scale), neg_inf = _mm512_set1_ps(kNegInf);
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  std::fill(S.o.begin(), S.o.end(), 0.0f);

  for (int64_t key0 = lo_key; key0 < n_keys; key0 += kKeyChunk) {
    const int64_t nt = std::min(kKeyChunk, n_keys - key0);
    // q.k: scores of 16 rows per key, kKeyGroup keys at a time.
    for (int64_t j0 = 0; j0 < nt; j0 += kKeyGroup) {
      for (int64_t j = 0; j < kKeyGroup; ++j)  // past the chunk: any valid row, never stored
        widen_row(key_row(kbase, key0 + std::min(j0 + j, nt - 1)), S.kf.data() + j * D, D);
      __m512 acc[kKeyGroup];
      for (int64_t j = 0; j < kKeyGroup; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int64_t d = 0; d < D; ++d) {
        const __m512 qd = _mm512_loadu_ps(S.qf.data() + d * 16);
        for (int64_t j = 0; j < kKeyGroup; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(S.kf[j * D + d]), acc[j]);
      }
      for (int64_t j = 0; j < kKeyGroup && j0 + j < nt; ++j) {
        const int64_t t = key0 + j0 + j;
        __m512 sc = _mm512_mul_ps(acc[j], scale);
        if (P.softcap > 0.0f) sc = soft_cap16(sc, P.softcap);
        if (t > first_pos) sc = _mm512_mask_mov_ps(sc, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(t), posv), neg_inf);
        if (P.window > 0 && t + P.window <= n_keys - 1)  // outside the window of the rows at t + window or later
          sc = _mm512_mask_mov_ps(sc, _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32(static_cast<int>(t + P.window))),
                                  neg_inf);
        _mm512_storeu_ps(S.st.data() + (j0 + j) * 16, sc);
      }
    }
    // Online softmax, elementwise over the 16 rows.
    __m512 cmax = neg_inf;
    for (int64_t t = 0; t < nt; ++t) cmax = _mm512_max_ps(cmax, _mm512_loadu_ps(S.st.data() + t * 16));
    // A row's max stays -inf until a chunk reaches its window; until then its state is zero.
    const __m512 m_new = _mm512_max_ps(m, cmax);
    const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ),
                                             exp512(_mm512_sub_ps(m, m_new)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {
      const __m512 sv = _mm512_loadu_ps(S.st.data() + t * 16);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(sv, m_new)));
      _mm512_storeu_ps(S.st.data() + t * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = m_new;
    for (int64_t t = 0; t < nt; ++t) widen_row(key_row(vbase, key0 + t), S.vf.data() + t * D, D);
    // p.V into the transposed output, 16 dims at a time (the rescale by alpha folded into the load).
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(S.o.data() + (d0 + i) * 16), alpha);
      for (int64_t t = 0; t < nt; ++t) {
        const __m512 pw = _mm512_loadu_ps(S.st.data() + t * 16);
        const float* vt = S.vf.data() + t * D + d0;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(pw, _mm512_set1_ps(vt[i]), acc[i]);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(S.o.data() + (d0 + i) * 16, acc[i]);
    }
  }

  alignas(64) float inv[16];
  _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r;
    T* dst = static_cast<T*>(P.out) + ((qs + row / G) * P.heads + it.kvh * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(S.o[d * 16 + r] * inv[r]);
  }
}

template <typename T>
void run_prefill_tiles(const PrefillParams& P, int64_t n_seqs) {
  run_tiles<16>(P, n_seqs, P.d == 64 ? &run_tile<T, 64> : P.d == 128 ? &run_tile<T, 128> : &run_tile<T, 0>);
}
#endif  // __AVX512F__

#if defined(TANDEM_AVX2)
// =============================================================================================
// AVX2 + FMA: the same tiles, 8 query rows per vector (float math whatever the storage)
// =============================================================================================
// A row as floats: a float row where it lies in the pool (its elements are broadcast one at a time,
// so a copy would only add loads and stores), others widened into dst.
template <typename T>
TANDEM_INLINE const float* as_floats(const T* src, float* dst, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
    return dst;
  }
}

// x, with v in the lanes drop sets.
TANDEM_INLINE __m256 where_not(__m256i drop, __m256 x, __m256 v) { return _mm256_blendv_ps(x, v, _mm256_castsi256_ps(drop)); }

template <typename T, int DC>
void run_tile8(const PrefillParams& P, const TileItem& it, TileScratch<8>& S) {
  const int64_t G = P.group, D = DC > 0 ? DC : P.d, BS = P.bs;
  const int64_t row_stride = P.kvh * D, block_stride = BS * row_stride;
  const int64_t qs = P.query_start[it.seq], q_len = P.query_start[it.seq + 1] - qs;
  const int64_t context = P.seq_lens[it.seq] - q_len;
  const int64_t first_pos = context + it.r0 / G, n_keys = context + (it.r0 + it.nr - 1) / G + 1;
  const int64_t lo_key = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.max_blocks;
  const T* kbase = static_cast<const T*>(P.k) + it.kvh * D;
  const T* vbase = static_cast<const T*>(P.v) + it.kvh * D;
  auto key_row = [&](const T* base, int64_t t) { return base + bt[t / BS] * block_stride + (t % BS) * row_stride; };

  alignas(32) int32_t pos[8];
  std::fill(S.qf.begin(), S.qf.end(), 0.0f);
  for (int64_t r = 0; r < 8; ++r) {
    const int64_t row = it.r0 + std::min<int64_t>(r, it.nr - 1);  // padding lanes repeat the last row's position
    pos[r] = static_cast<int32_t>(context + row / G);
    if (r >= it.nr) continue;
    const T* src = static_cast<const T*>(P.q) + (qs + row / G) * P.q_stride + (it.kvh * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) S.qf[d * 8 + r] = static_cast<float>(src[d]);
  }
  const __m256i posv = _mm256_load_si256(reinterpret_cast<const __m256i*>(pos));
  const __m256 scale = _mm256_set1_ps(P.scale), neg_inf = _mm256_set1_ps(kNegInf), zero = _mm256_setzero_ps();
  __m256 m = neg_inf, l = zero;
  std::fill(S.o.begin(), S.o.end(), 0.0f);

  for (int64_t key0 = lo_key; key0 < n_keys; key0 += kKeyChunk) {
    const int64_t nt = std::min(kKeyChunk, n_keys - key0);
    for (int64_t j0 = 0; j0 < nt; j0 += kKeyGroup) {
      const float* kr[kKeyGroup];
      for (int64_t j = 0; j < kKeyGroup; ++j)  // past the chunk: any valid row, never stored
        kr[j] = as_floats(key_row(kbase, key0 + std::min(j0 + j, nt - 1)), S.kf.data() + j * D, D);
      __m256 acc[kKeyGroup];
      for (int64_t j = 0; j < kKeyGroup; ++j) acc[j] = zero;
#pragma GCC unroll 4
      for (int64_t d = 0; d < D; ++d) {
        const __m256 qd = _mm256_loadu_ps(S.qf.data() + d * 8);
        for (int64_t j = 0; j < kKeyGroup; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_set1_ps(kr[j][d]), acc[j]);
      }
      for (int64_t j = 0; j < kKeyGroup && j0 + j < nt; ++j) {
        const int64_t t = key0 + j0 + j;
        __m256 sc = _mm256_mul_ps(acc[j], scale);
        if (P.softcap > 0.0f) sc = soft_cap8(sc, P.softcap);
        if (t > first_pos) sc = where_not(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(t)), posv), sc, neg_inf);
        if (P.window > 0 && t + P.window <= n_keys - 1)  // outside the window of the rows at t + window or later
          sc = where_not(_mm256_cmpgt_epi32(posv, _mm256_set1_epi32(static_cast<int>(t + P.window - 1))), sc, neg_inf);
        _mm256_storeu_ps(S.st.data() + (j0 + j) * 8, sc);
      }
    }
    // Online softmax, elementwise over the 8 rows; a row's state stays zero until its window starts.
    __m256 cmax = neg_inf;
    for (int64_t t = 0; t < nt; ++t) cmax = _mm256_max_ps(cmax, _mm256_loadu_ps(S.st.data() + t * 8));
    const __m256 m_new = _mm256_max_ps(m, cmax);
    const __m256 alpha = _mm256_and_ps(_mm256_cmp_ps(m, neg_inf, _CMP_NEQ_OQ), exp256(_mm256_sub_ps(m, m_new)));
    __m256 sum = zero;
    for (int64_t t = 0; t < nt; ++t) {
      const __m256 sv = _mm256_loadu_ps(S.st.data() + t * 8);
      const __m256 p = _mm256_and_ps(_mm256_cmp_ps(sv, neg_inf, _CMP_NEQ_OQ), exp256(_mm256_sub_ps(sv, m_new)));
      _mm256_storeu_ps(S.st.data() + t * 8, p);
      sum = _mm256_add_ps(sum, p);
    }
    l = _mm256_fmadd_ps(l, alpha, sum);
    m = m_new;
    const float* vr[kKeyChunk];
    for (int64_t t = 0; t < nt; ++t) vr[t] = as_floats(key_row(vbase, key0 + t), S.vf.data() + t * D, D);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(S.o.data() + (d0 + i) * 8), alpha);
      for (int64_t t = 0; t < nt; ++t) {
        const __m256 pw = _mm256_loadu_ps(S.st.data() + t * 8);
        const float* vt = vr[t] + d0;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(pw, _mm256_set1_ps(vt[i]), acc[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(S.o.data() + (d0 + i) * 8, acc[i]);
    }
  }

  alignas(32) float inv[8];
  _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), l));
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r;
    T* dst = static_cast<T*>(P.out) + ((qs + row / G) * P.heads + it.kvh * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(S.o[d * 8 + r] * inv[r]);
  }
}

template <typename T>
void run_prefill_tiles8(const PrefillParams& P, int64_t n_seqs) {
  run_tiles<8>(P, n_seqs, P.d == 64 ? &run_tile8<T, 64> : P.d == 128 ? &run_tile8<T, 128> : &run_tile8<T, 0>);
}
#endif  // TANDEM_AVX2

}  // namespace

// Writes into `out` ([T, H, D], contiguous, q's dtype), e.g. the prompt rows of a step's output.
at::Tensor& paged_prefill_attention_out(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& query_start,
                                        const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                        at::Tensor& out) {
  TORCH_CHECK(seq_lens.dim() == 1, "paged_prefill_attention: seq_lens must be [N]");
  const int64_t N = seq_lens.size(0);
  check_attention_inputs(q_in, k_cache, v_cache, block_tables, N, out, "paged_prefill_attention");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_prefill_attention: query_start and seq_lens must be int32");
  TORCH_CHECK(query_start.dim() == 1 && query_start.size(0) == N + 1, "query_start must be [N + 1]");
  const int64_t T = q_in.size(0), D = q_in.size(2);

  const at::Tensor q = packed_rows(q_in), bt = block_tables.contiguous(), qsl = query_start.contiguous();
  const at::Tensor sl = seq_lens.contiguous();
  TORCH_CHECK(qsl.data_ptr<int32_t>()[0] == 0 && qsl.data_ptr<int32_t>()[N] == T,
              "query_start must run from 0 to the number of query tokens");
  if (T == 0) return out;

  PrefillParams P{};
  fill_common_params(P, q, out, k_cache, v_cache, bt, sl, scale, window, softcap);
  P.query_start = qsl.data_ptr<int32_t>();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  validate(P, N, k_cache.size(0));
#if defined(__AVX512F__)
  // A few queries per sequence over a long context (speculative verification): the 16-row tiles read
  // each key once per 16 rows, where the brgemm path's blocks are mostly padding. Batch-invariant: every
  // row through brgemm, whose sums do not depend on the rows beside it (the batch's longest query would
  // otherwise pick the path).
  int64_t longest_query = 0;
  for (int64_t s = 0; s < N; ++s)
    longest_query = std::max<int64_t>(longest_query, P.query_start[s + 1] - P.query_start[s]);
  if (q.scalar_type() == at::kFloat)
    run_prefill_tiles<float>(P, N);
  else if (prefill_brgemm_usable(D) && (batch_invariant() || longest_query * P.group > kFewQueryRows))
    run_prefill_brgemm(P, N);
  else
    run_prefill_tiles<bf16>(P, N);
#elif defined(TANDEM_AVX2)
  q.scalar_type() == at::kFloat ? run_prefill_tiles8<float>(P, N) : run_prefill_tiles8<bf16>(P, N);
#else
  TORCH_CHECK(false, "paged_prefill_attention: this build has neither AVX512 nor AVX2 (use the PyTorch fallback)");
#endif
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start,
                                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  return paged_prefill_attention_out(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, softcap,
                                     out);
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
      "Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def(
      "paged_prefill_attention.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor seq_lens, float scale, int window=0, float softcap=0.0, *, "
      "Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_prefill_attention", &tandem_ops::paged_prefill_attention);
  m.impl("paged_prefill_attention.out", &tandem_ops::paged_prefill_attention_out);
}

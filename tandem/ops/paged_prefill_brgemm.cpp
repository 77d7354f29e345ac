// Paged prefill attention for bf16 with oneDNN's brgemm micro-kernels, on AMX or AVX512-BF16
// (see paged_prefill.cpp for the op and its contract).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "attention_common.h"
#include "paged_prefill.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace tandem_ops {

bool prefill_brgemm_usable(int64_t d) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  // oneDNN's brgemm runs bf16 on AMX tiles where the CPU has them and with dpbf16 where it does not;
  // on a Zen 4 (no AMX) this path ran 1.6x the float32 tiles of paged_prefill.cpp.
  return d % 32 == 0 && d <= 128;
#else
  (void)d;
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {
// =============================================================================================
// bf16: the two matmuls of a tile as brgemm calls (oneDNN's micro-kernels, as PyTorch's
// own CPU flash attention uses), the online softmax between them on AVX512.
// =============================================================================================
// A work item is (sequence, kv head, kBrgemmQueries queries): its M = kBrgemmQueries x group rows
// are one matrix A for both products. Keys go in chunks of kBrgemmKeys: S = Q K^T (M x kBrgemmKeys),
// the softmax update turns S into bf16 weights P, and O += P V (M x D). brgemm takes B in VNNI
// layout (pairs along the reduction dimension interleaved), so a pre-pass packs each chunk's K^T and
// V once per call, shared by every item of the sequence, instead of once per item.

constexpr int64_t kBrgemmKeys = 64;     // keys per chunk: N of S = Q K^T, K of O += P V
constexpr int64_t kBrgemmQueries = 16;  // queries per item

struct PrefillItemBrgemm {
  int32_t seq, kvh;
  int32_t q0, q1;  // queries [q0, q1) of the sequence
};


// Chunk c of sequence s, kv head h: K^T as [D/2][kBrgemmKeys] bf16 pairs, V as [kBrgemmKeys/2][D] bf16
// pairs; keys past the sequence are zero (and masked, being in every query's future).
void pack_chunk(const PrefillParams& P, int64_t s, int64_t c, int64_t h, uint32_t* kp, uint32_t* vp) {
  const int64_t D = P.d, DP = D / 2, BS = P.bs, row_stride = P.kvh * D;
  const int64_t key0 = c * kBrgemmKeys, nt = std::min<int64_t>(kBrgemmKeys, P.seq_lens[s] - key0);
  const int32_t* bt = P.block_tables + s * P.max_blocks;
  const bf16* k = static_cast<const bf16*>(P.k) + h * D;
  const bf16* v = static_cast<const bf16*>(P.v) + h * D;
  auto row = [&](const bf16* base, int64_t t) { return base + (bt[t / BS] * BS + t % BS) * row_stride; };
  for (int64_t t = 0; t < kBrgemmKeys; ++t) {
    const auto* kr = reinterpret_cast<const uint32_t*>(row(k, key0 + std::min(t, nt - 1)));
    for (int64_t dp = 0; dp < DP; ++dp) kp[dp * kBrgemmKeys + t] = t < nt ? kr[dp] : 0u;
  }
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t tp = 0; tp < kBrgemmKeys / 2; ++tp) {
    const int64_t t0 = 2 * tp, t1 = t0 + 1;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x0 = t0 < nt ? _mm512_loadu_si512(row(v, key0 + t0) + d) : _mm512_setzero_si512();
      const __m512i x1 = t1 < nt ? _mm512_loadu_si512(row(v, key0 + t1) + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + tp * D + d, _mm512_permutex2var_epi16(x0, lo_idx, x1));
      _mm512_storeu_si512(vp + tp * D + d + 16, _mm512_permutex2var_epi16(x0, hi_idx, x1));
    }
  }
}

struct BrgemmScratch {
  std::vector<bf16> q;    // [M][D]
  std::vector<float> s;   // [M][kBrgemmKeys]
  std::vector<bf16> p;    // [M][kBrgemmKeys]
  std::vector<float> o;   // [M][D]
  std::vector<float> m, l;
  BrgemmScratch(int64_t rows, int64_t d)
      : q(rows * d), s(rows * kBrgemmKeys), p(rows * kBrgemmKeys), o(rows * d), m(rows), l(rows) {}
};

void run_brgemm_item(const PrefillParams& P, const PrefillItemBrgemm& it, const uint32_t* kp_seq,
                     const uint32_t* vp_seq, BrgemmScratch& S) {
  const int64_t G = P.group, D = P.d, H = P.heads;
  const int64_t qs = P.query_start[it.seq], q_len = P.query_start[it.seq + 1] - qs;
  const int64_t context = P.seq_lens[it.seq] - q_len;
  const int64_t M = (it.q1 - it.q0) * G, n_keys = context + it.q1, first_pos = context + it.q0;
  const int64_t chunk_elems = D * kBrgemmKeys / 2;  // uint32 pairs per packed chunk (K^T or V)
  for (int64_t r = 0; r < M; ++r) {
    const bf16* src = static_cast<const bf16*>(P.q) + (qs + it.q0 + r / G) * P.q_stride + (it.kvh * G + r % G) * D;
    std::copy_n(src, D, S.q.data() + r * D);
  }
  std::fill_n(S.o.begin(), M * D, 0.0f);
  std::fill_n(S.m.begin(), M, kNegInf);
  std::fill_n(S.l.begin(), M, 0.0f);
  const __m512 scale = _mm512_set1_ps(P.scale), neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  // With a window, chunks before the first query's window are nobody's; rows mask the rest.
  const int64_t c_lo = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) / kBrgemmKeys : 0;
  for (int64_t c = c_lo; c * kBrgemmKeys < n_keys; ++c) {
    const int64_t key0 = c * kBrgemmKeys;
    const uint32_t* kp = kp_seq + (c * P.kvh + it.kvh) * chunk_elems;
    const uint32_t* vp = vp_seq + (c * P.kvh + it.kvh) * chunk_elems;
    at::native::cpublas::brgemm(M, kBrgemmKeys, D, D, kBrgemmKeys, kBrgemmKeys, false, S.q.data(),
                                reinterpret_cast<const bf16*>(kp), S.s.data(), true);
    for (int64_t r = 0; r < M; ++r) {
      float* sr = S.s.data() + r * kBrgemmKeys;
      const int64_t pos = first_pos + r / G;
      __m512 v[kBrgemmKeys / 16];
      __m512 vmax = neg_inf;
      for (int64_t j = 0; j < kBrgemmKeys / 16; ++j) {
        v[j] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * j), scale);
        if (P.softcap > 0.0f) v[j] = soft_cap16(v[j], P.softcap);
        const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + 16 * j)));
        if (key0 + 16 * j + 15 > pos)  // keys past the row's position are masked
          v[j] = _mm512_mask_mov_ps(v[j], _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos))), neg_inf);
        if (P.window > 0 && key0 + 16 * j + P.window <= pos)  // and keys before its window
          v[j] = _mm512_mask_mov_ps(
              v[j], _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos - P.window))), neg_inf);
        vmax = _mm512_max_ps(vmax, v[j]);
      }
      // -inf until a chunk reaches the row's window (alpha below is then 0 and the state stays zero).
      const float m_new = std::max(S.m[r], _mm512_reduce_max_ps(vmax));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      bf16* pr = S.p.data() + r * kBrgemmKeys;
      for (int64_t j = 0; j < kBrgemmKeys / 16; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v[j], neg_inf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(v[j], mv)));
        sum = _mm512_add_ps(sum, e);
        store16(pr + 16 * j, e);
      }
      const float alpha = S.m[r] == kNegInf ? 0.0f : std::exp(S.m[r] - m_new);
      S.l[r] = S.l[r] * alpha + _mm512_reduce_add_ps(sum);
      S.m[r] = m_new;
      if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(S.o.data() + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(S.o.data() + r * D + d), av));
      }
    }
    at::native::cpublas::brgemm(M, D, kBrgemmKeys, kBrgemmKeys, D, D, true, S.p.data(), reinterpret_cast<const bf16*>(vp),
                                S.o.data(), true);
  }
  for (int64_t r = 0; r < M; ++r) {
    bf16* dst = static_cast<bf16*>(P.out) + ((qs + it.q0 + r / G) * H + it.kvh * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / S.l[r]);
    for (int64_t d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(S.o.data() + r * D + d), inv));
  }
}

}  // namespace

void run_prefill_brgemm(const PrefillParams& P, int64_t n_seqs) {
  const int64_t chunk_elems = P.d * kBrgemmKeys / 2;
  std::vector<int64_t> chunk0(n_seqs + 1, 0);  // first packed chunk of each sequence
  for (int64_t s = 0; s < n_seqs; ++s) chunk0[s + 1] = chunk0[s] + (P.seq_lens[s] + kBrgemmKeys - 1) / kBrgemmKeys;
  // Uninitialised on purpose: pack_chunk writes every element (zeros past a sequence's end).
  const int64_t packed_elems = chunk0[n_seqs] * P.kvh * chunk_elems;
  std::unique_ptr<uint32_t[]> kp(new uint32_t[packed_elems]), vp(new uint32_t[packed_elems]);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (sequence, chunk)
  for (int64_t s = 0; s < n_seqs; ++s)
    for (int64_t c = 0; c < chunk0[s + 1] - chunk0[s]; ++c) chunks.emplace_back(s, c);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const auto [s, c] = chunks[i];
      for (int64_t h = 0; h < P.kvh; ++h) {
        const int64_t off = ((chunk0[s] + c) * P.kvh + h) * chunk_elems;
        pack_chunk(P, s, c, h, kp.get() + off, vp.get() + off);
      }
    }
  });

  std::vector<PrefillItemBrgemm> items;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t q_len = P.query_start[s + 1] - P.query_start[s];
    for (int64_t q0 = 0; q0 < q_len; q0 += kBrgemmQueries)
      for (int64_t h = 0; h < P.kvh; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(q0),
                         static_cast<int32_t>(std::min(q_len, q0 + kBrgemmQueries))});
  }
  auto work = [&](const PrefillItemBrgemm& a) {
    return (P.seq_lens[a.seq] - (P.query_start[a.seq + 1] - P.query_start[a.seq]) + a.q1) * (a.q1 - a.q0);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const PrefillItemBrgemm& a, const PrefillItemBrgemm& b) { return work(a) > work(b); });
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), n_items);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    BrgemmScratch scratch(kBrgemmQueries * P.group, P.d);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const PrefillItemBrgemm& it = items[i];
      const int64_t off = chunk0[it.seq] * P.kvh * chunk_elems;
      run_brgemm_item(P, it, kp.get() + off, vp.get() + off, scratch);
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#else
void run_prefill_brgemm(const PrefillParams&, int64_t) {
  TORCH_CHECK(false, "paged_prefill_attention: the brgemm path needs AVX512");
}
#endif  // __AVX512F__

}  // namespace tandem_ops

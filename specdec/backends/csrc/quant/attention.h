// Attention over a KV cache, one task per (position, head), keys visited in cache order.
#pragma once

#include "common.h"

namespace {

#if defined(__AVX512F__)
// Lane t of the result: the sum of acc[t]'s 16 lanes, by one fixed tree (halves of 128-bit quarters, then
// quarters, then pairs within a quarter), so a key's score depends on its own products alone.
inline __m512 reduce16(const __m512* acc) {
  __m512 r1[8], r2[4], r3[2];
  for (int p = 0; p < 8; ++p)  // quarters 0-1: key 2p's (q0 + q2, q1 + q3); quarters 2-3: key 2p + 1's
    r1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  for (int s = 0; s < 4; ++s)  // quarter c: key 4s + c, four partial sums
    r2[s] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * s], r1[2 * s + 1], 0x88),
                          _mm512_shuffle_f32x4(r1[2 * s], r1[2 * s + 1], 0xDD));
  for (int u = 0; u < 2; ++u)  // quarter c: keys 8u + c and 8u + 4 + c, two partial sums each
    r3[u] = _mm512_add_ps(_mm512_unpacklo_ps(r2[2 * u], r2[2 * u + 1]), _mm512_unpackhi_ps(r2[2 * u], r2[2 * u + 1]));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(r3[0]), _mm512_castps_pd(r3[1])));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(r3[0]), _mm512_castps_pd(r3[1])));
  // lane 4c + e holds key c + 4e
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                               _mm512_add_ps(lo, hi));
}

// score[t] = sc * (q . k_t) for the jn <= 16 keys at k (rows of 16 V floats); each dot product over its
// 16-lane chunks in order, then reduce16: the same operations for a key whatever block or query it is in.
template <int V>
inline void block_scores(const float* q, const float* k, int jn, float sc, float* score) {
  __m512 qv[V], acc[16];
  for (int e = 0; e < V; ++e) qv[e] = _mm512_loadu_ps(q + 16 * e);
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_setzero_ps();
    if (t < jn)
      for (int e = 0; e < V; ++e) acc[t] = _mm512_fmadd_ps(qv[e], _mm512_loadu_ps(k + t * 16 * V + 16 * e), acc[t]);
  }
  _mm512_storeu_ps(score, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(sc)));
}
#endif

// score[j] = sc * (q . k_j) for keys j < keys (rows of D floats at k); score has room for keys + 16.
inline void scores(const float* q, const float* k, int64_t keys, int64_t D, float sc, float* score) {
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    for (int64_t j0 = 0; j0 < keys; j0 += 16) {
      const int jn = static_cast<int>(std::min<int64_t>(16, keys - j0));
      if (D == 64)
        block_scores<4>(q, k + j0 * D, jn, sc, score + j0);
      else
        block_scores<8>(q, k + j0 * D, jn, sc, score + j0);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < keys; ++j) score[j] = dot(q, k + j * D, D) * sc;
}

template <int V>
inline void weighted_values(const float* p, const int64_t* seen, int64_t count, const float* values, float* acc) {
  vec a[V] = {};
  for (int64_t c = 0; c < count; ++c) {
    const float* row = values + seen[c] * (16 * V);
    const vec w = splat(p[c]);
    for (int e = 0; e < V; ++e) a[e] = fma(w, load(row + 16 * e), a[e]);
  }
  for (int e = 0; e < V; ++e) store(acc + 16 * e, a[e]);
}

// One attention over a cache: n new positions of q (row i at q + i * q_stride, H heads of D floats)
// over keys and values (KVH, cap, D) that hold them already at start..start+n-1, with mask (n,
// start+n) or null (causal); writes out (n, H * D).
struct Attention {
  const float* q;
  int64_t q_stride, n;
  const float *kp, *vp;
  int64_t cap, start;
  const bool* mask;
  float* out;
};

// Position i, head h of attention a; score, seen: room for start + n + 16 values, acc for D. Every
// visible key is scored (causally: keys 0..start+i), then the mask's are kept in cache order.
void attend_one(const Attention& a, int64_t i, int64_t h, int64_t H, int64_t D, int64_t KVH, float sc, float* score,
                int64_t* seen, float* acc) {
  const int64_t g = h / (H / KVH), keys = a.start + a.n;
  const float* qv = a.q + i * a.q_stride + h * D;
  const float* kg = a.kp + g * a.cap * D;
  const float* vg = a.vp + g * a.cap * D;
  int64_t count = a.mask ? keys : a.start + i + 1;
  scores(qv, kg, count, D, sc, score);
  if (a.mask) {
    count = 0;
    for (int64_t j = 0; j < keys; ++j)
      if (a.mask[i * keys + j]) {
        seen[count] = j;
        score[count++] = score[j];  // count <= j: in place
      }
  } else {
    for (int64_t j = 0; j < count; ++j) seen[j] = j;
  }
  float top = score[0];
  for (int64_t c = 1; c < count; ++c) top = std::max(top, score[c]);
  vec total = {};
  int64_t c = 0;
  for (; c + L <= count; c += L) {
    const vec e = vexp(load(score + c) - splat(top));
    store(score + c, e);
    total += e;
  }
  float sum = lane_sum(total);
  for (; c < count; ++c) {
    score[c] = sexp(score[c] - top);
    sum += score[c];
  }
  if (D == 64) {
    weighted_values<4>(score, seen, count, vg, acc);
  } else if (D == 128) {
    weighted_values<8>(score, seen, count, vg, acc);
  } else {
    std::fill(acc, acc + D, 0.0f);
    for (c = 0; c < count; ++c) {
      const float* vr = vg + seen[c] * D;
      const vec p = splat(score[c]);
      int64_t e = 0;
      for (; e + L <= D; e += L) store(acc + e, fma(p, load(vr + e), load(acc + e)));
      for (; e < D; ++e) acc[e] = std::fma(score[c], vr[e], acc[e]);
    }
  }
  float* o = a.out + i * H * D + h * D;
  for (int64_t e = 0; e < D; ++e) o[e] = acc[e] / sum;
}

// Several attentions (one per request of a batched forward, Vaswani et al. 2017) in one parallel
// region, one task per (attention, position, head). Grouped-query heads share a key head. The
// visible keys are visited in cache order, so a token sees the same keys in the same order however
// many positions, or other requests, the call has.
void attend_all(const std::vector<Attention>& parts, int64_t H, int64_t D, int64_t KVH, float sc) {
  std::vector<int64_t> first{0};  // the first task of each part
  int64_t keys = 0;
  for (const Attention& a : parts) {
    first.push_back(first.back() + a.n * H);
    keys = std::max(keys, a.start + a.n);
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(keys + 16), acc(D);
    std::vector<int64_t> seen(keys);
    size_t r = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[r + 1]) ++r;
      const int64_t local = task - first[r];
      attend_one(parts[r], local / H, local % H, H, D, KVH, sc, score.data(), seen.data(), acc.data());
    }
  });
}

// One attention (an Attention's fields, scale sc), as attend_all.
void attend(const float* q, int64_t q_stride, int64_t n, int64_t H, int64_t D, const float* kp, const float* vp,
            int64_t KVH, int64_t cap, int64_t start, const bool* mp, float sc, float* op) {
  attend_all({Attention{q, q_stride, n, kp, vp, cap, start, mp, op}}, H, D, KVH, sc);
}

const bool* mask_data(const c10::optional<torch::Tensor>& mask, torch::Tensor& holder, int64_t n, int64_t keys) {
  if (!mask.has_value()) return nullptr;
  holder = mask->to(torch::kBool).contiguous();
  TORCH_CHECK(holder.dim() == 2 && holder.size(0) == n && holder.size(1) == keys, "quant: mask must be (n, start + n)");
  return holder.data_ptr<bool>();
}

// q (n, H, D); k_cache, v_cache (KVH, capacity, D) fp32 contiguous, the new keys and values already at
// start..start+n-1; mask (n, start+n) bool or None (causal). Returns (n, H * D).
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                        c10::optional<torch::Tensor> mask, double scale) {
  q = q.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), cap = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && H % KVH == 0 && start + n <= cap,
              "quant.attention: bad cache");
  torch::Tensor holder;
  const bool* mp = mask_data(mask, holder, n, start + n);
  auto out = torch::empty({n, H * D}, q.options());
  attend(q.data_ptr<float>(), H * D, n, H, D, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), KVH, cap, start, mp,
         static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace

// Attention over a KV cache, one task per (position, head), keys visited in cache order.
#pragma once

#include "common.h"

namespace {

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

// Position i, head h of attention a; score, seen: room for start + n values, acc for D.
void attend_one(const Attention& a, int64_t i, int64_t h, int64_t H, int64_t D, int64_t KVH, float sc, float* score,
                int64_t* seen, float* acc) {
  const int64_t g = h / (H / KVH), keys = a.start + a.n;
  const float* qv = a.q + i * a.q_stride + h * D;
  const float* kg = a.kp + g * a.cap * D;
  const float* vg = a.vp + g * a.cap * D;
  int64_t count = 0;
  for (int64_t j = 0; j < keys; ++j) {
    if (a.mask ? !a.mask[i * keys + j] : j > a.start + i) continue;
    seen[count] = j;
    score[count++] = dot(qv, kg + j * D, D) * sc;
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
    std::vector<float> score(keys), acc(D);
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

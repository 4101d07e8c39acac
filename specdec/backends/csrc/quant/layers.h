// The Llama/Qwen2 decoder stack in one call, over one or more requests' new rows.
#pragma once

#include "attention.h"
#include "matmul.h"
#include "ops.h"

namespace {

// whole stack in one call without converting its tensors again. Each projection is a list of parts
// with their GGML types (q, k, v rows stacked, with their bias or None; gate rows then up rows).
// An empty norm_in: the layer attends over its input unnormalised (an EAGLE-1 draft head's layer).
struct Layer {
  torch::Tensor norm_in, norm_post;
  std::vector<torch::Tensor> qkv, o, gate_up, down;
  std::vector<int64_t> qkv_types, o_types, gate_up_types, down_types;
  c10::optional<torch::Tensor> qkv_bias;
};

// One request's share of a forward over several requests' rows: rows [offset, offset + n) of h,
// written to its own caches at start..start+n-1, attending over them with its mask (n, start+n),
// or causally when mask is null.
struct Segment {
  int64_t offset, n, start;
  const bool* mask;
};

// One decoder layer over the rows of every segment (pre-norm attention and SwiGLU MLP, residuals),
// its ops the batch-invariant ones above: the products and norms run over all rows at once, the
// attention of each segment over its own cache (keys[r], values[r]: (KVH, capacity, D), every cache fp32 or every
// one fp16, the new keys and values rounded to it). h (rows, d)
// fp32 is updated in place. rope: the rope_table (2, rows, D/2) of every row's position.
void decoder_layer(torch::Tensor& h, const Layer& w, const std::vector<Segment>& segments,
                   const std::vector<torch::Tensor*>& keys, const std::vector<torch::Tensor*>& values,
                   const torch::Tensor& rope, int64_t H, double eps, bool int8) {
  const int64_t rows = h.size(0);
  const torch::Tensor normed = w.norm_in.numel() ? rms_norm(h, w.norm_in, eps) : h;
  auto t = matmul(normed, w.qkv, w.qkv_types, w.qkv_bias, int8);  // (rows, (H + 2 KVH) D)
  const int64_t KVH = keys[0]->size(0), D = keys[0]->size(2), stride = t.size(1);
  TORCH_CHECK(H % KVH == 0 && stride == (H + 2 * KVH) * D, "quant.layers: qkv rows do not match the heads");
  float* tp = t.data_ptr<float>();
  rope_rows(tp, rows, stride, H + KVH, D, rope);
  auto a = torch::empty({rows, H * D}, h.options());
  with_cache_type(*keys[0], [&](auto e) {
    using T = decltype(e);
    std::vector<Attention<T>> attentions;
    for (size_t r = 0; r < segments.size(); ++r) {
      const Segment& seg = segments[r];
      torch::Tensor &k_cache = *keys[r], &v_cache = *values[r];
      TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == KVH && k_cache.size(2) == D &&
                      k_cache.scalar_type() == keys[0]->scalar_type() && v_cache.scalar_type() == keys[0]->scalar_type(),
                  "quant.layers: caches must be contiguous (", KVH, ", capacity, ", D, "), all of one dtype");
      const int64_t cap = k_cache.size(1);
      TORCH_CHECK(seg.start + seg.n <= cap, "quant.layers: the cache is too short");
      T *kp = static_cast<T*>(k_cache.data_ptr()), *vp = static_cast<T*>(v_cache.data_ptr());
      const float* rows_r = tp + seg.offset * stride;
      for (int64_t i = 0; i < seg.n; ++i)
        for (int64_t g = 0; g < KVH; ++g) {
          store_row(kp + (g * cap + seg.start + i) * D, rows_r + i * stride + (H + g) * D, D);
          store_row(vp + (g * cap + seg.start + i) * D, rows_r + i * stride + (H + KVH + g) * D, D);
        }
      float* out = a.data_ptr<float>() + seg.offset * H * D;
      attentions.push_back({rows_r, stride, seg.n, kp, vp, cap, seg.start, seg.mask, out});
    }
    attend_all(attentions, H, D, KVH, 1.0f / std::sqrt(static_cast<float>(D)));
  });
  h.add_(matmul(a, w.o, w.o_types, c10::nullopt, int8));
  h.add_(matmul(swiglu(matmul(rms_norm(h, w.norm_post, eps), w.gate_up, w.gate_up_types, c10::nullopt, int8)), w.down,
                w.down_types, c10::nullopt, int8));
}

// The decoder stack over the new positions of one or more requests (continuous batching): h
// (sum n_r, d) fp32, the rows of request r at sum n_<r .. (counts[r] of them), updated in place and
// returned. keys[r][i], values[r][i]: request r's caches of layer i (KVH, capacity, D), written at
// starts[r]..; masks[r] (n_r, starts[r] + n_r) bool or None (causal). After the layers listed in
// taps, request r's rows of h are also written to features[r][starts[r] : starts[r] + n_r, d*(1+t)
// : d*(2+t)] (t the tap's index), the hidden states an EAGLE head reads. Each row has the bits it
// has in a forward of its request alone.
torch::Tensor layers(torch::Tensor h, const std::vector<std::shared_ptr<Layer>>& stack,
                     std::vector<std::vector<torch::Tensor>> keys, std::vector<std::vector<torch::Tensor>> values,
                     std::vector<int64_t> starts, std::vector<int64_t> counts, torch::Tensor rope,
                     std::vector<c10::optional<torch::Tensor>> masks, int64_t H, double eps, bool int8,
                     std::vector<int64_t> taps, std::vector<torch::Tensor> features) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat, "quant.layers: h must be (n, d) fp32");
  const size_t R = counts.size();
  TORCH_CHECK(R > 0 && keys.size() == R && values.size() == R && starts.size() == R && masks.size() == R &&
                  features.size() == R,
              "quant.layers: one cache list, start, count, mask and features per request");
  std::vector<torch::Tensor> holders(R);
  std::vector<Segment> segments;
  int64_t offset = 0;
  for (size_t r = 0; r < R; ++r) {
    TORCH_CHECK(counts[r] > 0 && keys[r].size() == stack.size() && values[r].size() == stack.size(),
                "quant.layers: request ", r, " needs at least one row and one cache per layer");
    const bool* mask = mask_data(masks[r], holders[r], counts[r], starts[r] + counts[r]);
    segments.push_back({offset, counts[r], starts[r], mask});
    offset += counts[r];
  }
  TORCH_CHECK(offset == h.size(0), "quant.layers: the counts must add up to h's rows");
  const int64_t d = h.size(1);
  std::vector<torch::Tensor*> k(R), v(R);
  for (size_t i = 0; i < stack.size(); ++i) {
    for (size_t r = 0; r < R; ++r) {
      k[r] = &keys[r][i];
      v[r] = &values[r][i];
    }
    decoder_layer(h, *stack[i], segments, k, v, rope, H, eps, int8);
    const auto tap = std::find(taps.begin(), taps.end(), static_cast<int64_t>(i));
    if (tap != taps.end())
      for (size_t r = 0; r < R; ++r)
        features[r].narrow(0, starts[r], counts[r]).narrow(1, d * (1 + (tap - taps.begin())), d)
            .copy_(h.narrow(0, segments[r].offset, counts[r]));
  }
  return h;
}

}  // namespace

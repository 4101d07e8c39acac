// The Llama/Qwen2 decoder stack in one call, over one or more requests' new rows.
#pragma once

#include "attention.h"
#include "matmul.h"
#include "ops.h"

namespace {

// One decoder layer's weights, which the Python side hands to `layers` once so that a forward runs the
// whole stack in one call without converting its tensors again. Each projection is a list of parts
// with their GGML types (q, k, v rows stacked, with their bias or None; gate rows then up rows).
// The rest says how this architecture's layer differs from Llama's (specdec.backends.arch): an empty
// norm is no norm (norm_in empty: the layer attends over its input unnormalised, as an EAGLE-1 draft
// head's layer and OLMo 2's do).
struct Layer {
  torch::Tensor norm_in, norm_post;  // RMSNorm weights before attention and before the feed-forward
  std::vector<torch::Tensor> qkv, o, gate_up, down;
  std::vector<int64_t> qkv_types, o_types, gate_up_types, down_types;
  c10::optional<torch::Tensor> qkv_bias;
  torch::Tensor q_norm, k_norm;  // (D,): a head at a time (Qwen3, Gemma 3); (H D,), (KVH D,): whole (OLMo 2)
  torch::Tensor attn_out_norm, ffn_out_norm;  // norms of each block's output before its residual add
  int64_t rope = 0;       // which of the forward's rope tables rotates q and k; -1: none (SmolLM3's NoPE layers)
  bool window = false;    // attends through the sliding-window masks (Gemma 3's local layers)
  bool gelu = false;      // GELU-tanh gate (Gemma) instead of SiLU
  double scale = 0;       // attention's scale of q.k; 0: 1/sqrt(D)
  double residual = 1;    // each block's output times this before its residual add (Granite)
};

// One request's share of a forward over several requests' rows: rows [offset, offset + n) of h,
// written to its own caches at start..start+n-1, attending over them with its mask (n, start+n),
// or causally when mask is null.
struct Segment {
  int64_t offset, n, start;
  const bool* mask;
  const bool* window;  // the sliding-window layers' mask (n, start + n); mask's where it would hide nothing more
};

// q and k of every row normalised (a q/k norm) and rotated, as layer w says. t: (rows, stride) the qkv
// product, q's H heads then k's KVH heads of D floats.
void prepare_qk(float* t, int64_t rows, int64_t stride, const Layer& w, int64_t H, int64_t KVH, int64_t D,
                const std::vector<torch::Tensor>& ropes, double eps) {
  if (w.q_norm.numel()) {
    const bool whole = w.q_norm.numel() == H * D;  // else (D,): a head at a time
    rms_norm_runs(t, rows, stride, 0, whole ? H * D : D, whole ? 1 : H, w.q_norm, eps);
    rms_norm_runs(t, rows, stride, H * D, whole ? KVH * D : D, whole ? 1 : KVH, w.k_norm, eps);
  }
  if (w.rope >= 0) {
    TORCH_CHECK(w.rope < static_cast<int64_t>(ropes.size()), "quant.layers: the layer's rope table is missing");
    rope_rows(t, rows, stride, H + KVH, D, ropes[w.rope]);
  }
}

// x = x + residual * norm(y) (norm empty: y alone), in place: a block's output joining the residual stream.
void add_block(torch::Tensor& x, torch::Tensor y, const torch::Tensor& norm, double residual, double eps) {
  if (norm.numel()) y = rms_norm(y, norm, eps);
  if (residual != 1) y.mul_(static_cast<float>(residual));
  x.add_(y);
}

// One decoder layer over the rows of every segment (attention and the gated feed-forward, with the
// norms and residuals layer w has), its ops the batch-invariant ones above: the products and norms
// run over all rows at once, the attention of each segment over its own cache (keys[r], values[r]:
// (KVH, capacity, D), every cache fp32 or every one fp16, the new keys and values rounded to it),
// with the segments' sliding-window masks where w.window. h (rows, d) fp32 is updated in place.
// ropes: the rope_tables (2, rows, D/2) of every row's position, one per frequency set.
void decoder_layer(torch::Tensor& h, const Layer& w, const std::vector<Segment>& segments,
                   const std::vector<torch::Tensor*>& keys, const std::vector<torch::Tensor*>& values,
                   const std::vector<torch::Tensor>& ropes, int64_t H, double eps, bool int8) {
  const int64_t rows = h.size(0);
  const torch::Tensor normed = w.norm_in.numel() ? rms_norm(h, w.norm_in, eps) : h;
  auto t = matmul(normed, w.qkv, w.qkv_types, w.qkv_bias, int8);  // (rows, (H + 2 KVH) D)
  const int64_t KVH = keys[0]->size(0), D = keys[0]->size(2), stride = t.size(1);
  TORCH_CHECK(H % KVH == 0 && stride == (H + 2 * KVH) * D, "quant.layers: qkv rows do not match the heads");
  float* tp = t.data_ptr<float>();
  prepare_qk(tp, rows, stride, w, H, KVH, D, ropes, eps);
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
      attentions.push_back({rows_r, stride, seg.n, kp, vp, cap, seg.start, w.window ? seg.window : seg.mask, out});
    }
    const double scale = w.scale ? w.scale : 1.0 / std::sqrt(static_cast<double>(D));
    attend_all(attentions, H, D, KVH, static_cast<float>(scale));
  });
  add_block(h, matmul(a, w.o, w.o_types, c10::nullopt, int8), w.attn_out_norm, w.residual, eps);
  const torch::Tensor ffn_in = w.norm_post.numel() ? rms_norm(h, w.norm_post, eps) : h;
  const auto gate_up = matmul(ffn_in, w.gate_up, w.gate_up_types, c10::nullopt, int8);
  add_block(h, matmul(w.gelu ? geglu(gate_up) : swiglu(gate_up), w.down, w.down_types, c10::nullopt, int8),
            w.ffn_out_norm, w.residual, eps);
}

// The decoder stack over the new positions of one or more requests (continuous batching): h
// (sum n_r, d) fp32, the rows of request r at sum n_<r .. (counts[r] of them), updated in place and
// returned. keys[r][i], values[r][i]: request r's caches of layer i (KVH, capacity, D), written at
// starts[r]..; masks[r] (n_r, starts[r] + n_r) bool or None (causal); windows[r] the same for the
// sliding-window layers, or None: masks[r]. ropes: the rope tables the layers name. After the layers listed in
// taps, request r's rows of h are also written to features[r][starts[r] : starts[r] + n_r, d*(1+t)
// : d*(2+t)] (t the tap's index), the hidden states an EAGLE head reads. Each row has the bits it
// has in a forward of its request alone.
torch::Tensor layers(torch::Tensor h, const std::vector<std::shared_ptr<Layer>>& stack,
                     std::vector<std::vector<torch::Tensor>> keys, std::vector<std::vector<torch::Tensor>> values,
                     std::vector<int64_t> starts, std::vector<int64_t> counts, std::vector<torch::Tensor> ropes,
                     std::vector<c10::optional<torch::Tensor>> masks,
                     std::vector<c10::optional<torch::Tensor>> windows, int64_t H, double eps, bool int8,
                     std::vector<int64_t> taps, std::vector<torch::Tensor> features) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat, "quant.layers: h must be (n, d) fp32");
  const size_t R = counts.size();
  TORCH_CHECK(R > 0 && keys.size() == R && values.size() == R && starts.size() == R && masks.size() == R &&
                  windows.size() == R && features.size() == R,
              "quant.layers: one cache list, start, count, mask, window mask and features per request");
  std::vector<torch::Tensor> holders(2 * R);
  std::vector<Segment> segments;
  int64_t offset = 0;
  for (size_t r = 0; r < R; ++r) {
    TORCH_CHECK(counts[r] > 0 && keys[r].size() == stack.size() && values[r].size() == stack.size(),
                "quant.layers: request ", r, " needs at least one row and one cache per layer");
    const bool* mask = mask_data(masks[r], holders[r], counts[r], starts[r] + counts[r]);
    const bool* window = mask_data(windows[r], holders[R + r], counts[r], starts[r] + counts[r]);
    segments.push_back({offset, counts[r], starts[r], mask, window ? window : mask});
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
    decoder_layer(h, *stack[i], segments, k, v, ropes, H, eps, int8);
    const auto tap = std::find(taps.begin(), taps.end(), static_cast<int64_t>(i));
    if (tap != taps.end())
      for (size_t r = 0; r < R; ++r)
        features[r].narrow(0, starts[r], counts[r]).narrow(1, d * (1 + (tap - taps.begin())), d)
            .copy_(h.narrow(0, segments[r].offset, counts[r]));
  }
  return h;
}

}  // namespace

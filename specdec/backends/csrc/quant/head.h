// An EAGLE draft head's step on the quantized kernels, in one call.
#pragma once

#include "layers.h"

namespace {

// The head's weights (specdec.train.head.DraftHead, Li et al. 2024, "EAGLE"): fc (d rows, 2d
// columns: the token's embedding, then the feature), one decoder layer, and the output layer's rows
// of the head's vocabulary (N rows, d columns); each a list of GGML parts with their types; and the
// target's input embedding table (V, row_bytes) of GGML type embed_type, whose rows it gathers.
struct Head {
  std::vector<torch::Tensor> fc, out;
  std::vector<int64_t> fc_types, out_types;
  std::shared_ptr<Layer> layer;
  torch::Tensor embed;
  int64_t embed_type;
};

// One step of the head over T positions start..start+T-1: features (T, d) fp32 (the target's, or
// the head's own prediction) and ids (T,) the tokens that follow them -> {h (T, d), the
// predicted next features; logits (1, N) of h's last row over the head's vocabulary}. The layer
// attends causally over its own cache (k_cache, v_cache: (KVH, capacity, D), fp32 or fp16), whose
// positions start.. it writes. inv_freq (D/2,): the rotary embedding's frequencies.
std::vector<torch::Tensor> head_step(const Head& w, torch::Tensor features, torch::Tensor ids, torch::Tensor k_cache,
                                     torch::Tensor v_cache, int64_t start, torch::Tensor inv_freq, int64_t H, double eps,
                                     bool int8) {
  TORCH_CHECK(features.dim() == 2 && features.size(0) > 0 && features.scalar_type() == torch::kFloat &&
                  ids.numel() == features.size(0),
              "quant.head_step: features must be (T, d) fp32, T >= 1, with T ids");
  const int64_t T = features.size(0);
  const auto embeds = dequantize_rows(w.embed, w.embed_type, features.size(1), ids);  // (T, d)
  TORCH_CHECK(start >= 0 && start + T <= k_cache.size(1), "quant.head_step: the head's cache is too short");
  auto h = matmul(torch::cat({embeds, features}, 1), w.fc, w.fc_types, c10::nullopt, int8);  // (T, d)
  const std::vector<Segment> segments{{0, T, start, nullptr, nullptr}};
  const auto rope = rope_table(torch::arange(start, start + T, torch::kLong), inv_freq);
  decoder_layer(h, *w.layer, segments, {&k_cache}, {&v_cache}, {rope}, H, eps, int8);
  return {h, matmul(h.narrow(0, T - 1, 1), w.out, w.out_types, c10::nullopt, int8)};
}

}  // namespace

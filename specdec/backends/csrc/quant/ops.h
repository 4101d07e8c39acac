// The forward's other row-wise ops: RMSNorm, SwiGLU, the rotary embedding.
#pragma once

#include "common.h"

namespace {

// ---- the rest of the forward -----------------------------------------------------------------

// RMSNorm per row (Zhang & Sennrich 2019): x (n, d) -> x / sqrt(mean(x^2) + eps) * w.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  const int64_t n = x.size(0), d = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = xp + i * d;
      const float inv = 1.0f / std::sqrt(dot(r, r, d) / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t e = 0; e < d; ++e) yp[i * d + e] = (r[e] * inv) * wp[e];
    }
  });
  return y;
}

// RMSNorm in place over `groups` consecutive runs of `width` floats from column `col` of each of n rows
// (row i at x + i * stride), every run times the same weight w (width,): a q/k norm a head at a time
// (Qwen3, Gemma 3: width D, groups H) or over the whole projection (OLMo 2: width H * D, one group).
// Each run is reduced alone, in the order rms_norm uses, so a row's bits do not depend on the others.
void rms_norm_runs(float* x, int64_t n, int64_t stride, int64_t col, int64_t width, int64_t groups,
                   const torch::Tensor& w, double eps) {
  TORCH_CHECK(w.numel() == width && w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "quant: a q/k norm's weight must be fp32 (", width, ",)");
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, row_grain(width * groups), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        float* r = x + i * stride + col + g * width;
        const float inv = 1.0f / std::sqrt(dot(r, r, width) / static_cast<float>(width) + static_cast<float>(eps));
        for (int64_t e = 0; e < width; ++e) r[e] = (r[e] * inv) * wp[e];
      }
  });
}

// The gated feed-forward's product (Shazeer 2020): gate_up (n, 2F), the gate then the up projection
// -> act(gate) * up, (n, F). act: the activation of 16 lanes, act_one the same function of one value
// (the row's tail), so every element is computed the same way whatever the row's length.
template <typename Act, typename ActOne>
torch::Tensor gated(torch::Tensor gate_up, Act act, ActOne act_one) {
  gate_up = gate_up.contiguous();
  const int64_t n = gate_up.size(0), F = gate_up.size(1) / 2;
  auto y = torch::empty({n, F}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, row_grain(2 * F), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *g = gp + i * 2 * F, *u = g + F;
      float* o = yp + i * F;
      int64_t e = 0;
      for (; e + L <= F; e += L) store(o + e, act(load(g + e)) * load(u + e));
      for (; e < F; ++e) o[e] = act_one(g[e]) * u[e];
    }
  });
  return y;
}

// SwiGLU: silu(gate) * up.
torch::Tensor swiglu(torch::Tensor gate_up) {
  return gated(
      gate_up, [](vec g) { return g / (splat(1.0f) + vexp(-g)); }, [](float g) { return g / (1.0f + sexp(-g)); });
}

// GEGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh): gelu_tanh(gate) * up, with
// tanh(y) = 1 - 2 / (e^(2y) + 1) through our own exp.
torch::Tensor geglu(torch::Tensor gate_up) {
  constexpr float c = 0.7978845608028654f, a = 0.044715f;  // sqrt(2 / pi), the cubic's coefficient
  return gated(
      gate_up,
      [](vec x) {
        const vec t = splat(1.0f) - splat(2.0f) / (vexp(splat(2.0f * c) * (x + splat(a) * x * x * x)) + splat(1.0f));
        return splat(0.5f) * x * (splat(1.0f) + t);
      },
      [](float x) {
        const float t = 1.0f - 2.0f / (sexp(2.0f * c * (x + a * x * x * x)) + 1.0f);
        return 0.5f * x * (1.0f + t);
      });
}

// The rotary embedding's angles (Su et al. 2021) at positions (n,) for inv_freq (D/2,): (2, n, D/2) fp32,
// their cos then their sin. Angle = float(position) * inv_freq[k], cos and sin from the C library.
// Computed once per forward and shared by its layers.
torch::Tensor rope_table(torch::Tensor positions, torch::Tensor inv_freq) {
  positions = positions.to(torch::kLong).contiguous();
  inv_freq = inv_freq.to(torch::kFloat).contiguous();
  const int64_t n = positions.numel(), half = inv_freq.numel();
  auto table = torch::empty({2, n, half}, torch::kFloat);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  float *c = table.data_ptr<float>(), *s = c + n * half;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < half; ++k) {
      const float angle = static_cast<float>(pos[i]) * f[k];
      c[i * half + k] = std::cos(angle);
      s[i * half + k] = std::sin(angle);
    }
  return table;
}

// Rotary embedding, rotate-half layout, in place on `heads` vectors of D floats at the start of each
// of n rows (row i at x + i * stride), with row i's cos and sin from a rope_table (2, n, D/2).
void rope_rows(float* x, int64_t n, int64_t stride, int64_t heads, int64_t D, const torch::Tensor& table) {
  TORCH_CHECK(table.dim() == 3 && table.size(0) == 2 && table.size(1) == n && table.size(2) * 2 == D &&
                  table.is_contiguous() && table.scalar_type() == torch::kFloat,
              "quant: the rope table must be (2, n, D/2) fp32, as rope_table makes it");
  const int64_t half = D / 2;
  const float* cos_table = table.data_ptr<float>();
  const float* sin_table = cos_table + n * half;
  for (int64_t i = 0; i < n; ++i) {
    const float *c = cos_table + i * half, *s = sin_table + i * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + i * stride + h * D;
      for (int64_t k = 0; k < half; ++k) {
        const float a = v[k], b = v[k + half];
        v[k] = a * c[k] - b * s[k];
        v[k + half] = b * c[k] + a * s[k];
      }
    }
  }
}

// x (n, heads, D) fp32 contiguous, in place; positions (n,) integers; inv_freq (D/2,) fp32.
void rope(torch::Tensor x, torch::Tensor positions, torch::Tensor inv_freq) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "quant.rope: x must be contiguous fp32 (n, heads, D)");
  rope_rows(x.data_ptr<float>(), x.size(0), x.size(1) * x.size(2), x.size(1), x.size(2), rope_table(positions, inv_freq));
}

// acc[0..16 V) = sum over c < count, in order, of p[c] * values[seen[c]] (rows of 16 V floats): the

}  // namespace

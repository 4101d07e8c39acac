// matmul: x W^T over stacked parts of any handled type, each part on its fastest batch-invariant kernel.
#pragma once

#include "amx.h"
#include "fp32.h"
#include "int8_avx2.h"
#include "int8_x16.h"
#include "int8_x16_avx2.h"

namespace {

#if defined(SPECDEC_INT8)
constexpr bool HAS_Q8 = true;
#else
constexpr bool HAS_Q8 = false;
#endif

// The int8 kernels this build has: "vnni", "avx2", or "" (none: fp32 activations only).
inline std::string int8_kernels() {
#if defined(SPECDEC_VNNI)
  return "vnni";
#elif defined(SPECDEC_AVX2_INT8)
  return "avx2";
#else
  return "";
#endif
}

// Bytes per group of sixteen rows of a regrouped type id (regroup.h, int8 builds); 0 for the others.
inline int64_t regrouped_row_bytes(int64_t type, int64_t K) {
#if defined(SPECDEC_INT8)
  return regrouped_bytes(type, K);
#else
  (void)type, (void)K;
  return 0;
#endif
}

// matmul's three steps: check the parts and find where each one's outputs start (part_offsets),
// round the input rows to int8 the ways the parts' kernels read them (Inputs::prepare), then run each
// thread's rows of each part on its kernel (part_products).

// The first output column of each part, then N (the total); grouped: whether a part is regrouped sixteen
// rows at a time (threads then take whole groups). Raises for a part that does not fit its type and K.
struct Offsets {
  std::vector<int64_t> at{0};
  bool grouped = false;
};
inline Offsets part_offsets(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types, int64_t K,
                            bool int8) {
  Offsets o;
  for (size_t p = 0; p < parts.size(); ++p) {
#if defined(SPECDEC_INT8)
    if (const int64_t group_bytes = regrouped_bytes(types[p], K)) {
      TORCH_CHECK(int8, "quant.matmul: a regrouped part needs int8 activations");
      TORCH_CHECK(K % layout(regrouped_base(types[p])).block == 0 && parts[p].dim() == 2 &&
                      parts[p].scalar_type() == torch::kUInt8 && parts[p].is_contiguous() &&
                      parts[p].size(1) == group_bytes,
                  "quant.matmul: part ", p, " must be repack's (N / 16, ", group_bytes, ")");
      o.at.push_back(o.at.back() + GROUP * parts[p].size(0));
      o.grouped = true;
      continue;
    }
#else
    (void)int8;
#endif
    const Layout lay = layout(types[p]);
    TORCH_CHECK(K % lay.block == 0, "quant.matmul: K = ", K, " is not a multiple of the block size ", lay.block);
    TORCH_CHECK(parts[p].dim() == 2 && parts[p].scalar_type() == torch::kUInt8 && parts[p].is_contiguous() &&
                    parts[p].size(1) == K / lay.block * lay.bytes,
                "quant.matmul: part ", p, " must be contiguous uint8 (N, ", K / lay.block * lay.bytes, ")");
    o.at.push_back(o.at.back() + parts[p].size(0));
  }
  for (int64_t at : o.at)
    TORCH_CHECK(!o.grouped || at % GROUP == 0,
                "quant.matmul: with a regrouped part, every part's rows must come in sixteens");
  return o;
}

// The input rows as the int8 kernels read them: per 32 columns (qx, the 32-weight types; biases[o]:
// -o * sum4 for a type whose weights are stored with offset o) and per 256 columns (kx: the K-quants,
// IQ4_XS); only the roundings some part's kernel needs. Empty in builds without int8 kernels.
struct Inputs {
#if defined(SPECDEC_INT8)
  QRows qx;
  KRows kx;
  std::vector<std::vector<int32_t>> biases = std::vector<std::vector<int32_t>>(129);

  void prepare(const float* xp, int64_t M, int64_t K, const std::vector<int64_t>& types) {
    bool legacy = false, super = false, row_at_a_time = false;  // which input roundings the parts need
    for (int64_t t : types) {
      const bool regrouped = regrouped_row_bytes(t, K) != 0;
      const int64_t base = regrouped ? t - X16 : t;
      if (!has_int8_kernel(base)) continue;  // F32, Q3_K, ...: fp32 activations, no int8 rounding for them
      const bool per_256 = layout(base).block == 256;  // inputs rounded per 256 columns (the K-quants, IQ4_XS)
      (per_256 ? super : legacy) = true;
      row_at_a_time |= !regrouped && !per_256;
    }
    if (super) quantize_rows_k(xp, M, K, kx);
    if (!legacy) return;
    quantize_rows(xp, M, K, qx, row_at_a_time);
    for (int64_t t : types) if (!regrouped_row_bytes(t, K)) dispatch(t, [&]<int64_t type>() {
        constexpr int32_t o = offset_of<type>();
        if (type == F32 || o == 0 || !biases[o].empty()) return;
        biases[o].resize(qx.sum4.size());
        for (size_t i = 0; i < qx.sum4.size(); ++i) biases[o][i] = -o * qx.sum4[i];
      });
  }
#endif
};

// Outputs lo..hi of part p (rows its own, from its first output column `first`) into y (M, N), on the part's
// fastest kernel: regrouped (AMX tiles where on), the K-quants' and 32-weight types' int8 kernels, else fp32.
inline void part_outputs_of(const torch::Tensor& part, int64_t type, int64_t first, int64_t lo, int64_t hi,
                            const float* xp, int64_t M, int64_t K, const Inputs& in, bool int8, float* yp, int64_t N) {
  const int64_t row_bytes = part.size(1);
  const uint8_t* rows = part.data_ptr<uint8_t>() + (lo - first) * row_bytes;
#if defined(SPECDEC_INT8)
  if (regrouped_bytes(type, K)) {
    const uint8_t* groups = part.data_ptr<uint8_t>() + (lo - first) / GROUP * row_bytes;
#if defined(SPECDEC_VNNI)
    const bool tiles = amx_on() && amx_outputs(type, groups, row_bytes, lo, hi, in.qx, in.kx, yp, N);
#else
    const bool tiles = false;
#endif
    if (!tiles) regrouped_outputs(type, groups, row_bytes, lo, hi, in.qx, in.kx, yp, N);
    return;
  }
#else
  (void)in;
#endif
  dispatch(type, [&]<int64_t t>() {
#if defined(SPECDEC_INT8)
    if constexpr (t == Q4_K || t == Q6_K) {
      if (int8) {
        part_outputs_k<t>(rows, row_bytes, lo, hi, in.kx, yp, N);
        return;
      }
    } else if constexpr (halves_type(t)) {
      if (int8) {
        if constexpr (t != IQ4_NL)  // the 256-column types
          part_outputs_k<t, true>(rows, row_bytes, lo, hi, in.kx, yp, N);
        else
          part_outputs_q8<t, true>(rows, row_bytes, lo, hi, in.qx, nullptr, yp, N);
        return;
      }
    } else if constexpr (has_int8_kernel(t)) {
      if (int8) {
        constexpr int32_t o = offset_of<t>();
        part_outputs_q8<t>(rows, row_bytes, lo, hi, in.qx, o ? in.biases[o].data() : nullptr, yp, N);
        return;
      }
    }
#endif
    part_outputs<t>(rows, row_bytes, lo, hi, K, xp, M, yp, N);
  });
}

// Every part's outputs, each thread taking whole units of output columns (sixteen with a regrouped part),
// each part's share of them on its kernel, then the bias b (N,) or none.
inline void part_products(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types,
                          const Offsets& off, const float* xp, int64_t M, int64_t K, const Inputs& in, bool int8,
                          const float* b, float* yp) {
  const int64_t N = off.at.back(), unit = off.grouped ? GROUP : 1;  // rows a thread takes together
  at::parallel_for(0, N / unit, 16 / unit, [&](int64_t begin_unit, int64_t end_unit) {
    const int64_t begin = begin_unit * unit, end = end_unit * unit;
    for (size_t p = 0; p < parts.size(); ++p) {
      const int64_t lo = std::max(begin, off.at[p]), hi = std::min(end, off.at[p + 1]);
      if (lo >= hi) continue;
      part_outputs_of(parts[p], types[p], off.at[p], lo, hi, xp, M, K, in, int8, yp, N);
      if (b)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = lo; j < hi; ++j) yp[m * N + j] += b[j];
    }
  });
}

// x: (M, K) fp32; parts: matrices (N_p, row_bytes) uint8 of GGML types `types`, each with K columns;
// bias: (sum N_p,) fp32 or None. Returns (M, sum N_p) = x W^T + b, W the parts stacked and
// dequantized. Each output is one thread's dot product in a fixed order, so its bits do not depend
// on M, on the other rows, or on the thread count.
torch::Tensor matmul(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                     c10::optional<torch::Tensor> bias, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant.matmul: x must be (M, K) fp32");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "quant.matmul: one type per part");
  TORCH_CHECK(!int8 || HAS_Q8, "quant.matmul: int8 activations need AVX2 or AVX512-VNNI (see int8_available())");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Offsets off = part_offsets(parts, types, K, int8);
  const int64_t N = off.at.back();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
                "quant.matmul: bias must be contiguous fp32 (", N, ",)");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  Inputs in;
#if defined(SPECDEC_INT8)
  if (int8) in.prepare(xp, M, K, types);
#endif
  part_products(parts, types, off, xp, M, K, in, int8, b, y.data_ptr<float>());
  return y;
}

// Rows `ids` of a (V, row_bytes) matrix of GGML type `type` with K columns, dequantized: (n, K) fp32.
torch::Tensor dequantize_rows(torch::Tensor w, int64_t type, int64_t K, torch::Tensor ids) {
  const Layout lay = layout(type);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && K % lay.block == 0 &&
                  w.size(1) == K / lay.block * lay.bytes,
              "quant.dequantize_rows: bad weight");
  ids = ids.to(torch::kLong).contiguous();
  const int64_t n = ids.numel(), V = w.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= idp[i] && idp[i] < V, "token id ", idp[i], " out of range [0, ", V, ")");
  auto out = torch::empty({n, K}, torch::kFloat);
  for (int64_t i = 0; i < n; ++i) decode_row(type, w.data_ptr<uint8_t>() + idp[i] * w.size(1), K, out.data_ptr<float>() + i * K);
  return out;
}

}  // namespace

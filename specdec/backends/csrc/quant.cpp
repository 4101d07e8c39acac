// Batch-invariant CPU kernels for a forward over GGUF weights kept in their quantized blocks.
//
// Every output of every function here is computed by one fixed sequence of fp32 operations that
// depends only on that output's own inputs: never on how many rows the call has, which other rows
// are in it, or how many threads run it. Row i of an n-row call therefore has the bits of a
// one-row call, so a verify forward over k+1 tokens equals k+1 one-token forwards bit for bit, and
// greedy speculative decoding equals plain greedy decoding by construction.
//
// How: each output is reduced by one thread (work is split over outputs, never inside a sum); a
// sum runs over 16-lane vectors in a fixed order with one final lane reduction; multiply-adds are
// explicit (the file is built with -ffp-contract=off, so the compiler never fuses differently for
// different row counts); exp is our own polynomial, the same code for every call.
//
// The weights: a matrix is (rows, row_bytes) uint8, each row its blocks as ggml lays them out
// (ggml-common.h: block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0, block_q4_K,
// block_q6_K) or plain fp32. A row is dequantized once per call into L1, exactly as ggml
// dequantizes it, and multiplied with every input row there. Activations stay fp32, so a product
// is the fp32 dot product of the input with the dequantized weights, summed in a fixed order.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

typedef float vec __attribute__((vector_size(64)));  // 16 fp32 lanes
typedef int32_t ivec __attribute__((vector_size(64)));

constexpr int L = 16;  // lanes

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec splat(float s) { return vec{} + s; }

inline vec fma(vec a, vec b, vec c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float half __attribute__((vector_size(32)));
  half lo = _mm256_fmadd_ps(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                            __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                            __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  half hi = _mm256_fmadd_ps(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                            __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                            __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vec r;
  for (int i = 0; i < L; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline float lane_sum(vec a) {
  typedef float half __attribute__((vector_size(32)));
  typedef float quarter __attribute__((vector_size(16)));
  half h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// x . y over n floats: 16-lane fused multiply-adds in order, then the tail one by one.
inline float dot(const float* x, const float* y, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = fma(load(x + i), load(y + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s = std::fma(x[i], y[i], s);
  return s;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// e^x for 16 lanes (Cody-Waite range reduction, degree-6 polynomial; relative error about 2e-7).
// Our own so that its bits never depend on which library routine or vector width runs it.
inline vec vexp(vec x) {
  const vec hi = splat(88.0f), lo = splat(-87.0f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vec n = fma(x, splat(1.44269504088896341f), magic) - magic;
  vec r = fma(n, splat(-0.693359375f), x);
  r = fma(n, splat(2.12194440e-4f), r);
  vec p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  p = fma(p, r * r, r) + splat(1.0f);
  ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

inline float sexp(float x) {  // the same e^x for one value, through lane 0
  vec v = splat(x);
  return vexp(v)[0];
}

// ---- decoding a row of blocks -------------------------------------------------------------

enum Type : int64_t { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

inline Layout layout(int64_t type) {
  switch (type) {
    case F32: return {L, 4 * L};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "specdec quant: unsupported GGML type ", type);
}

// 16 bytes widened to 16 int32 lanes, unsigned or signed.
inline ivec widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  ivec v;
  for (int i = 0; i < L; ++i) v[i] = p[i];
  return v;
#endif
}
inline ivec widen_s8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  ivec v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<int8_t>(p[i]);
  return v;
#endif
}
inline vec to_float(ivec v) { return __builtin_convertvector(v, vec); }
inline ivec lanes_from(int start) {
  ivec v;
  for (int i = 0; i < L; ++i) v[i] = start + i;
  return v;
}

// Writes the row's K weights, dequantized as ggml dequantizes them (dequantize_row_*: scale times
// the quantized integer, plus the block's minimum where the type has one), to w[0..K) in fp32.
// Scale times integer is exact in fp32 for every type here, so the only rounding is the minimum's
// addition.
template <int64_t type>
void decode_blocks(const uint8_t* row, int64_t K, float* w) {
  const Layout lay = layout(type);
  const int64_t blocks = K / lay.block;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * lay.bytes;
    float* out = w + b * lay.block;
    if constexpr (type == F32) {
      std::memcpy(out, p, L * sizeof(float));
    } else if constexpr (type == Q4_0 || type == Q4_1) {
      const vec d = splat(half_to_float(p)), m = splat(type == Q4_1 ? half_to_float(p + 2) : 0.0f);
      const ivec q = widen_u8(p + (type == Q4_1 ? 4 : 2)), shift = ivec{} + (type == Q4_0 ? 8 : 0);
      store(out, to_float((q & 15) - shift) * d + m);
      store(out + 16, to_float((q >> 4) - shift) * d + m);
    } else if constexpr (type == Q5_0 || type == Q5_1) {
      const int head = type == Q5_1 ? 4 : 2;
      const vec d = splat(half_to_float(p)), m = splat(type == Q5_1 ? half_to_float(p + 2) : 0.0f);
      uint32_t qh;
      std::memcpy(&qh, p + head, 4);
      const ivec high = ivec{} + static_cast<int32_t>(qh), shift = ivec{} + (type == Q5_0 ? 16 : 0);
      const ivec q = widen_u8(p + head + 4);
      store(out, to_float(((q & 15) | (((high >> lanes_from(0)) & 1) << 4)) - shift) * d + m);
      store(out + 16, to_float(((q >> 4) | (((high >> lanes_from(16)) & 1) << 4)) - shift) * d + m);
    } else if constexpr (type == Q8_0) {
      const vec d = splat(half_to_float(p));
      store(out, to_float(widen_s8(p + 2)) * d);
      store(out + 16, to_float(widen_s8(p + 18)) * d);
    } else if constexpr (type == Q4_K) {
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      const uint8_t* sc = p + 4;
      const uint8_t* qs = p + 16;
      for (int j = 0; j < 8; ++j) {  // sub-block j: 32 weights, a 6-bit scale and minimum (get_scale_min_k4)
        int a, c;
        if (j < 4) {
          a = sc[j] & 63;
          c = sc[j + 4] & 63;
        } else {
          a = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
          c = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const vec s = splat(d * static_cast<float>(a)), m = splat(dmin * static_cast<float>(c));
        const uint8_t* q = qs + 32 * (j / 2);  // even sub-blocks take the low nibbles, odd ones the high
        const ivec q0 = widen_u8(q), q1 = widen_u8(q + 16);
        store(out + 32 * j, to_float(j % 2 ? q0 >> 4 : q0 & 15) * s - m);
        store(out + 32 * j + 16, to_float(j % 2 ? q1 >> 4 : q1 & 15) * s - m);
      }
    } else if constexpr (type == Q6_K) {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_to_float(p + 208);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* l = ql + 64 * half;
        const uint8_t* h = qh + 32 * half;
        const int8_t* s = sc + 8 * half;
        float* o = out + 128 * half;
        for (int part = 0; part < 2; ++part) {  // lanes 16 * part .. 16 * part + 15 of each quarter
          const ivec a = widen_u8(l + 16 * part), c = widen_u8(l + 32 + 16 * part), hb = widen_u8(h + 16 * part);
          const ivec q1 = ((a & 15) | ((hb & 3) << 4)) - 32;
          const ivec q2 = ((c & 15) | (((hb >> 2) & 3) << 4)) - 32;
          const ivec q3 = ((a >> 4) | (((hb >> 4) & 3) << 4)) - 32;
          const ivec q4 = ((c >> 4) | (((hb >> 6) & 3) << 4)) - 32;
          store(o + 16 * part, to_float(q1) * splat(d * s[part]));
          store(o + 32 + 16 * part, to_float(q2) * splat(d * s[part + 2]));
          store(o + 64 + 16 * part, to_float(q3) * splat(d * s[part + 4]));
          store(o + 96 + 16 * part, to_float(q4) * splat(d * s[part + 6]));
        }
      }
    }
  }
}

void decode_row(int64_t type, const uint8_t* row, int64_t K, float* w) {
  switch (type) {
    case F32: return decode_blocks<F32>(row, K, w);
    case Q4_0: return decode_blocks<Q4_0>(row, K, w);
    case Q4_1: return decode_blocks<Q4_1>(row, K, w);
    case Q5_0: return decode_blocks<Q5_0>(row, K, w);
    case Q5_1: return decode_blocks<Q5_1>(row, K, w);
    case Q8_0: return decode_blocks<Q8_0>(row, K, w);
    case Q4_K: return decode_blocks<Q4_K>(row, K, w);
    case Q6_K: return decode_blocks<Q6_K>(row, K, w);
  }
  TORCH_CHECK(false, "specdec quant: unsupported GGML type ", type);
}

// ---- products ------------------------------------------------------------------------------

// y[m] = w . x[m] for the T rows m of one tile: each 32 weights' first 16 lanes go to one
// accumulator, the next 16 to a second (two independent chains), then one lane reduction of their
// sum. The order depends on K alone.
template <int T>
void tile(const float* w, int64_t K, const float* x, float* y, int64_t y_stride) {
  vec even[T] = {}, odd[T] = {};
  int64_t c = 0;
  for (; c + 32 <= K; c += 32) {
    const vec w0 = load(w + c), w1 = load(w + c + 16);
    for (int m = 0; m < T; ++m) {
      even[m] = fma(w0, load(x + m * K + c), even[m]);
      odd[m] = fma(w1, load(x + m * K + c + 16), odd[m]);
    }
  }
  if (c < K) {  // K = 32 j + 16 (fp32 rows only)
    const vec w0 = load(w + c);
    for (int m = 0; m < T; ++m) even[m] = fma(w0, load(x + m * K + c), even[m]);
  }
  for (int m = 0; m < T; ++m) y[m * y_stride] = lane_sum(even[m] + odd[m]);
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr int TILE = 6;
const TileFn tiles[TILE + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// x: (M, K) fp32; parts: matrices (N_p, row_bytes) uint8 of GGML types `types`, each with K columns;
// bias: (sum N_p,) fp32 or None. Returns (M, sum N_p) = x W^T + b, W the parts stacked and
// dequantized. Each output is one thread's dot product in a fixed order (tile), so its bits do not
// depend on M, on the other rows, or on the thread count.
torch::Tensor matmul(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant.matmul: x must be (M, K) fp32");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "quant.matmul: one type per part");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> offsets{0};
  for (size_t p = 0; p < parts.size(); ++p) {
    const Layout lay = layout(types[p]);
    TORCH_CHECK(K % lay.block == 0, "quant.matmul: K = ", K, " is not a multiple of the block size ", lay.block);
    TORCH_CHECK(parts[p].dim() == 2 && parts[p].scalar_type() == torch::kUInt8 && parts[p].is_contiguous() &&
                    parts[p].size(1) == K / lay.block * lay.bytes,
                "quant.matmul: part ", p, " must be contiguous uint8 (N, ", K / lay.block * lay.bytes, ")");
    offsets.push_back(offsets.back() + parts[p].size(0));
  }
  const int64_t N = offsets.back();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
                "quant.matmul: bias must be contiguous fp32 (", N, ",)");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> w(K);
    for (size_t p = 0; p < parts.size(); ++p) {
      const int64_t lo = std::max(begin, offsets[p]), hi = std::min(end, offsets[p + 1]);
      if (lo >= hi) continue;
      const int64_t row_bytes = parts[p].size(1);
      const uint8_t* wp = parts[p].data_ptr<uint8_t>();
      for (int64_t j = lo; j < hi; ++j) {
        decode_row(types[p], wp + (j - offsets[p]) * row_bytes, K, w.data());
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
          const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
          tiles[t](w.data(), K, xp + m0 * K, yp + m0 * N + j, N);
        }
        if (b)
          for (int64_t m = 0; m < M; ++m) yp[m * N + j] += b[j];
      }
    }
  });
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

// ---- the rest of the forward -----------------------------------------------------------------

// RMSNorm per row (Zhang & Sennrich 2019): x (n, d) -> x / sqrt(mean(x^2) + eps) * w.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  const int64_t n = x.size(0), d = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = xp + i * d;
      const float inv = 1.0f / std::sqrt(dot(r, r, d) / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t e = 0; e < d; ++e) yp[i * d + e] = (r[e] * inv) * wp[e];
    }
  });
  return y;
}

// SwiGLU (Shazeer 2020): gate_up (n, 2F), the gate then the up projection -> silu(gate) * up, (n, F).
torch::Tensor swiglu(torch::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  const int64_t n = gate_up.size(0), F = gate_up.size(1) / 2;
  auto y = torch::empty({n, F}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *g = gp + i * 2 * F, *u = g + F;
      float* o = yp + i * F;
      int64_t e = 0;
      for (; e + L <= F; e += L) {
        const vec gv = load(g + e);
        store(o + e, gv / (splat(1.0f) + vexp(-gv)) * load(u + e));
      }
      for (; e < F; ++e) o[e] = g[e] / (1.0f + sexp(-g[e])) * u[e];
    }
  });
  return y;
}

// Rotary embedding (Su et al. 2021), rotate-half layout: x (n, heads, D) in place, at `positions` (n,);
// inv_freq (D/2,). Angle = float(position) * inv_freq[i], cos and sin from the C library.
void rope(torch::Tensor x, torch::Tensor positions, torch::Tensor inv_freq) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat, "quant.rope: x must be contiguous fp32");
  positions = positions.to(torch::kLong).contiguous();
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  std::vector<float> c(half), s(half);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < half; ++k) {
      const float angle = static_cast<float>(pos[i]) * f[k];
      c[k] = std::cos(angle);
      s[k] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xp + (i * heads + h) * D;
      for (int64_t k = 0; k < half; ++k) {
        const float a = v[k], b = v[k + half];
        v[k] = a * c[k] - b * s[k];
        v[k + half] = b * c[k] + a * s[k];
      }
    }
  }
}

// Attention of n new positions over a cache (Vaswani et al. 2017), one (position, head) per task:
// q (n, H, D); k_cache, v_cache (KVH, capacity, D) holding the new keys and values at start..start+n-1
// already; mask (n, start+n) bool or None (causal: position i sees 0..start+i). Grouped-query heads
// share a key head. The visible keys are visited in cache order, so a token sees the same keys in
// the same order however many positions the call has. Returns (n, H * D).
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                        c10::optional<torch::Tensor> mask, double scale) {
  q = q.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), cap = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && H % KVH == 0 && start + n <= cap,
              "quant.attention: bad cache");
  const bool* mp = nullptr;
  torch::Tensor m;
  if (mask.has_value()) {
    m = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(m.size(0) == n && m.size(1) == start + n, "quant.attention: mask must be (n, start + n)");
    mp = m.data_ptr<bool>();
  }
  auto out = torch::empty({n, H * D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(start + n);
    std::vector<int64_t> seen(start + n);
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / H, h = task % H, g = h / (H / KVH);
      const float* qv = qp + (i * H + h) * D;
      const float* kg = kp + g * cap * D;
      const float* vg = vp + g * cap * D;
      int64_t count = 0;
      for (int64_t j = 0; j < start + n; ++j) {
        if (mp ? !mp[i * (start + n) + j] : j > start + i) continue;
        seen[count] = j;
        score[count++] = dot(qv, kg + j * D, D) * sc;
      }
      float top = score[0];
      for (int64_t c = 1; c < count; ++c) top = std::max(top, score[c]);
      vec total = {};
      int64_t c = 0;
      for (; c + L <= count; c += L) {
        const vec e = vexp(load(score.data() + c) - splat(top));
        store(score.data() + c, e);
        total += e;
      }
      float sum = lane_sum(total);
      for (; c < count; ++c) {
        score[c] = sexp(score[c] - top);
        sum += score[c];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (c = 0; c < count; ++c) {
        const float* vr = vg + seen[c] * D;
        const vec p = splat(score[c]);
        int64_t e = 0;
        for (; e + L <= D; e += L) store(acc.data() + e, fma(p, load(vr + e), load(acc.data() + e)));
        for (; e < D; ++e) acc[e] = std::fma(score[c], vr[e], acc[e]);
      }
      float* o = op + i * H * D + h * D;
      for (int64_t e = 0; e < D; ++e) o[e] = acc[e] / sum;
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x W^T (+ b) over GGML-quantized weight parts, batch-invariant");
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGML-quantized matrix as fp32");
  m.def("rms_norm", &rms_norm, "RMSNorm per row");
  m.def("swiglu", &swiglu, "silu(gate) * up");
  m.def("rope", &rope, "rotary embedding in place, rotate-half layout");
  m.def("attention", &attention, "causal or masked attention over a KV cache, one task per position and head");
}

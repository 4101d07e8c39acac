// Shared by every kernel: 16-lane vectors, their fixed-order sums, e^x, the GGML types' block sizes.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__) || defined(__SSSE3__)
#include <immintrin.h>
#endif

// Which int8-activation kernels this build has (int8.h): AVX512-VNNI's (int8_vnni.h, with the regrouped
// rows of int8_x16.h and the AMX tiles of amx.h), else AVX2's (int8_avx2.h, with the regrouped rows of
// int8_x16_avx2.h), else none. The regrouped layouts: regroup.h.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPECDEC_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_AVX2_INT8 1
#endif
#if defined(SPECDEC_VNNI) || defined(SPECDEC_AVX2_INT8)
#define SPECDEC_INT8 1
#endif

namespace {

typedef float vec __attribute__((vector_size(64)));  // 16 fp32 lanes
typedef int32_t ivec __attribute__((vector_size(64)));

constexpr int L = 16;  // lanes
constexpr int64_t GROUP = 16;  // weight rows a regrouped matrix interleaves (quant/regroup.h)
constexpr int64_t X16 = 200;    // a regrouped layout's type id is X16 + its GGML type (not a GGML type)

// Rows a thread takes at least in a row-wise op over rows of `width` elements: torch's grain size
// (at::internal::GRAIN_SIZE elements), so a verify block's few short rows run on the calling thread
// instead of paying a parallel region (one per op) for microseconds of work. Who computes a row
// never changes how.
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width));
}

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
// s in every lane, -0 included (vec{} + s, zeros plus s, would make it +0). With AVX2 alone, from two
// 8-lane halves: GCC keeps a 16-lane vector as two, and a 16-lane broadcast made Q4_K's decoding 16% slower.
inline vec splat(float s) {
#if defined(__AVX__) && !defined(__AVX512F__)
  union {
    __m256 h[2];
    vec v;
  } r{{_mm256_set1_ps(s), _mm256_set1_ps(s)}};  // as fma's halves: a shuffle of them went lane by lane
  return r.v;
#else
  return s - vec{};
#endif
}

// A KV cache holds fp32 or fp16 (c10::Half: IEEE binary16). An fp16 element widens to fp32 exactly, so
// what attention computes from it depends on the stored bits alone, whichever path widens it.
using half = c10::Half;
inline vec load(const half* p) {  // 16 fp16 values, widened
#if defined(__AVX512F__)
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  typedef float eight __attribute__((vector_size(32)));
  const eight lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const eight hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vec v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// n values of src written to dst as the cache's type: copied (fp32), or rounded to the nearest fp16, ties to
// even (the same rounding with or without F16C).
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + L <= n; i += L)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = half(src[i]);
}

inline vec fma(vec a, vec b, vec c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  // The two 8-lane halves through a union: GCC keeps each in its ymm register. Taking them with
  // __builtin_shufflevector instead made GCC 12 move every lane through the stack (vinsertps and
  // vextractps), about 7x slower than reading the weights; the arithmetic, lane by lane, is the same.
  union Halves {
    vec v;
    __m256 h[2];
  };
  const Halves x{a}, y{b};
  Halves z{c};
  z.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
  z.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
  return z.v;
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

// With AVX2 but no AVX-512, GCC keeps a 16-lane `vec` in memory (there is no 64-byte register), so a
// loop that carries one (an accumulator) goes through the stack at every step. The hot loops carry
// two 8-lane halves instead (lanes 0-7, 8-15): the same operations lane by lane, so the same bits.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if !defined(__AVX512F__)
#define SPECDEC_HALVES 1
#endif
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float lane_sum(__m256 lo, __m256 hi) {  // lane_sum of the 16 lanes lo, hi: the same additions
  const __m256 h = _mm256_add_ps(lo, hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  return (q[0] + q[2]) + (q[1] + q[3]);
}
#endif

// x . y over n values (y fp32 or fp16): 16-lane fused multiply-adds in order, then the tail one by one.
template <typename T>
inline float dot(const float* x, const T* y, int64_t n) {
  int64_t i = 0;
#if defined(SPECDEC_HALVES)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (; i + L <= n; i += L) {
    lo = _mm256_fmadd_ps(load8(x + i), load8(y + i), lo);
    hi = _mm256_fmadd_ps(load8(x + i + 8), load8(y + i + 8), hi);
  }
  float s = lane_sum(lo, hi);
#else
  vec acc = {};
  for (; i + L <= n; i += L) acc = fma(load(x + i), load(y + i), acc);
  float s = lane_sum(acc);
#endif
  for (; i < n; ++i) s = std::fma(x[i], static_cast<float>(y[i]), s);
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


// GGML type ids (ggml.h).
enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
  Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30
};

// Of the types with int8 kernels, those whose products run in 8-lane halves in every int8 build, VNNI's
// included (quant/int8_halves.h), a row at a time, never regrouped.
constexpr bool halves_type(int64_t type) { return type == Q5_K || type == IQ4_XS || type == IQ4_NL; }

// Whether the int8 path (SPECDEC_INT8) has kernels for a type. The others, F32 included, run the
// fp32-activation kernel there too: their rows are neither regrouped nor met with int8 inputs.
constexpr bool has_int8_kernel(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K ||
         type == Q6_K || halves_type(type);
}

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

inline Layout layout(int64_t type) {
  switch (type) {
    case F32: return {32, 128};  // plain values go 32 at a time too, as the decoders emit them
    case F16: return {32, 64};
    case BF16: return {32, 64};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q5_K: return {256, 176};
    case IQ4_NL: return {32, 18};
    case IQ4_XS: return {256, 136};
  }
  TORCH_CHECK(false, "specdec quant: unsupported GGML type ", type);
}

// 16 bytes widened to 16 int32 lanes, unsigned or signed.
#if defined(__AVX2__)
// With AVX2 alone, two 8-lane halves through a union (as in fma: GCC's lane-by-lane loop here was
// scalar code); the same integers either way.
union IntHalves {
  ivec v;
  __m256i h[2];
};
#endif
inline ivec widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  IntHalves r;
  r.h[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  r.h[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  return r.v;
#else
  ivec v;
  for (int i = 0; i < L; ++i) v[i] = p[i];
  return v;
#endif
}
inline ivec widen_s8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  IntHalves r;
  r.h[0] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  r.h[1] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  return r.v;
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

}  // namespace

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
// block_q6_K) or plain fp32. Two product paths: fp32 activations (a row is dequantized in
// registers exactly as ggml dequantizes it, and the product is the fp32 dot product of the input
// with those weights), and, on CPUs with AVX512-VNNI, int8 activations (each input row rounded to
// int8 per block, integer dot products with the weights' integers, as llama.cpp multiplies).
// Both are batch-invariant.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <sys/mman.h>
#include <unistd.h>
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
    case F32: return {32, 128};
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

// Dequantizes a row of K weights as ggml does (dequantize_row_*: scale times the quantized integer,
// plus the block's minimum where the type has one) and hands them to emit(c, w0, w1) 32 at a time,
// in order: w0 holds weights c..c+15, w1 weights c+16..c+31. Scale times integer is exact in fp32
// for every type here, so the only rounding is the minimum's addition, and a fused multiply-add
// gives the same bits as ggml's multiply then add.
// Sub-block j's 6-bit scale and minimum from a Q4_K block's 12 scale bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* sc, int j, int& scale, int& minimum) {
  if (j < 4) {
    scale = sc[j] & 63;
    minimum = sc[j + 4] & 63;
  } else {
    scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    minimum = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

template <int64_t type, typename Emit>
inline void decode_blocks(const uint8_t* row, int64_t K, Emit&& emit) {
  const Layout lay = layout(type);
  const int64_t blocks = K / lay.block;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * lay.bytes;
    const int64_t c = b * lay.block;
    if constexpr (type == F32) {
      const float* f = reinterpret_cast<const float*>(p);
      emit(c, load(f), load(f + 16));
    } else if constexpr (type == Q4_0 || type == Q4_1) {
      const vec d = splat(half_to_float(p)), m = splat(type == Q4_1 ? half_to_float(p + 2) : 0.0f);
      const ivec q = widen_u8(p + (type == Q4_1 ? 4 : 2)), shift = ivec{} + (type == Q4_0 ? 8 : 0);
      emit(c, fma(to_float((q & 15) - shift), d, m), fma(to_float((q >> 4) - shift), d, m));
    } else if constexpr (type == Q5_0 || type == Q5_1) {
      const int head = type == Q5_1 ? 4 : 2;
      const vec d = splat(half_to_float(p)), m = splat(type == Q5_1 ? half_to_float(p + 2) : 0.0f);
      uint32_t qh;
      std::memcpy(&qh, p + head, 4);
      const ivec high = ivec{} + static_cast<int32_t>(qh), shift = ivec{} + (type == Q5_0 ? 16 : 0);
      const ivec q = widen_u8(p + head + 4);
      emit(c, fma(to_float(((q & 15) | (((high >> lanes_from(0)) & 1) << 4)) - shift), d, m),
           fma(to_float(((q >> 4) | (((high >> lanes_from(16)) & 1) << 4)) - shift), d, m));
    } else if constexpr (type == Q8_0) {
      const vec d = splat(half_to_float(p));
      emit(c, to_float(widen_s8(p + 2)) * d, to_float(widen_s8(p + 18)) * d);
    } else if constexpr (type == Q4_K) {
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      const uint8_t* sc = p + 4;
      const uint8_t* qs = p + 16;
      for (int j = 0; j < 8; ++j) {  // sub-block j: 32 weights, a 6-bit scale and minimum
        int a, e;
        scale_min_k4(sc, j, a, e);
        const vec s = splat(d * static_cast<float>(a)), m = splat(-(dmin * static_cast<float>(e)));
        const uint8_t* q = qs + 32 * (j / 2);  // even sub-blocks take the low nibbles, odd ones the high
        const ivec q0 = widen_u8(q), q1 = widen_u8(q + 16);
        emit(c + 32 * j, fma(to_float(j % 2 ? q0 >> 4 : q0 & 15), s, m), fma(to_float(j % 2 ? q1 >> 4 : q1 & 15), s, m));
      }
    } else if constexpr (type == Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_to_float(p + 208);
      for (int half = 0; half < 2; ++half) {  // 128 weights: four quarters of 32, each two scales of 16
        const uint8_t* l = p + 64 * half;
        const uint8_t* h = p + 128 + 32 * half;
        const int8_t* s = sc + 8 * half;
        const ivec a0 = widen_u8(l), a1 = widen_u8(l + 16), c0 = widen_u8(l + 32), c1 = widen_u8(l + 48);
        const ivec h0 = widen_u8(h), h1 = widen_u8(h + 16);
        const int64_t o = c + 128 * half;
        emit(o, to_float(((a0 & 15) | ((h0 & 3) << 4)) - 32) * splat(d * s[0]),
             to_float(((a1 & 15) | ((h1 & 3) << 4)) - 32) * splat(d * s[1]));
        emit(o + 32, to_float(((c0 & 15) | (((h0 >> 2) & 3) << 4)) - 32) * splat(d * s[2]),
             to_float(((c1 & 15) | (((h1 >> 2) & 3) << 4)) - 32) * splat(d * s[3]));
        emit(o + 64, to_float(((a0 >> 4) | (((h0 >> 4) & 3) << 4)) - 32) * splat(d * s[4]),
             to_float(((a1 >> 4) | (((h1 >> 4) & 3) << 4)) - 32) * splat(d * s[5]));
        emit(o + 96, to_float(((c0 >> 4) | (((h0 >> 6) & 3) << 4)) - 32) * splat(d * s[6]),
             to_float(((c1 >> 4) | (((h1 >> 6) & 3) << 4)) - 32) * splat(d * s[7]));
      }
    }
  }
}

// Calls f.template operator()<type>() for a run-time GGML type id.
template <typename F>
inline void dispatch(int64_t type, F&& f) {
  switch (type) {
    case F32: return f.template operator()<F32>();
    case Q4_0: return f.template operator()<Q4_0>();
    case Q4_1: return f.template operator()<Q4_1>();
    case Q5_0: return f.template operator()<Q5_0>();
    case Q5_1: return f.template operator()<Q5_1>();
    case Q8_0: return f.template operator()<Q8_0>();
    case Q4_K: return f.template operator()<Q4_K>();
    case Q6_K: return f.template operator()<Q6_K>();
  }
  TORCH_CHECK(false, "specdec quant: unsupported GGML type ", type);
}

void decode_row(int64_t type, const uint8_t* row, int64_t K, float* w) {
  dispatch(type, [&]<int64_t t>() {
    decode_blocks<t>(row, K, [&](int64_t c, vec w0, vec w1) {
      store(w + c, w0);
      store(w + c + 16, w1);
    });
  });
}

// ---- products ------------------------------------------------------------------------------
//
// Every output y[m, j] = w_j . x_m is summed the same way: over the row's 32-weight chunks in order,
// the first 16 lanes of each chunk into one accumulator and the next 16 into a second (two
// independent chains), then one lane reduction of their sum. The order depends on K alone. Input
// rows go in tiles of up to TILE, each tile dequantizing the weight row again in registers: the
// same values, the same operations, whatever the tile or the column block.

constexpr int TILE = 8;

// Continues the accumulators of one output for T input rows (acc: even, odd per row) over columns
// [k0, k0 + kn) of its weight row, kn a multiple of the type's block.
template <int64_t type, int T>
void rows_partial(const uint8_t* row, int64_t k0, int64_t kn, int64_t K, const float* x, vec* acc) {
  const Layout lay = layout(type);
  vec even[T], odd[T];
  for (int m = 0; m < T; ++m) {
    even[m] = acc[2 * m];
    odd[m] = acc[2 * m + 1];
  }
  decode_blocks<type>(row + k0 / lay.block * lay.bytes, kn, [&](int64_t c, vec w0, vec w1) {
    for (int m = 0; m < T; ++m) {
      even[m] = fma(w0, load(x + m * K + k0 + c), even[m]);
      odd[m] = fma(w1, load(x + m * K + k0 + c + 16), odd[m]);
    }
  });
  for (int m = 0; m < T; ++m) {
    acc[2 * m] = even[m];
    acc[2 * m + 1] = odd[m];
  }
}

// Several input rows whose columns do not fit in L1 (a tile of 8 rows of 1536 floats is 48 KB) are
// multiplied KB columns at a time, for JB weight rows, their accumulators kept in memory between
// passes: the same operations per output, in the same order, as one pass over the whole row.
constexpr int64_t KB = 512;
constexpr int64_t JB = 8;

// y[:, j] for j in [lo, hi) of one part: rows (hi - lo, row_bytes) of type `type`; x (M, K); y (M, N).
template <int64_t type>
void part_outputs(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, int64_t K, const float* x,
                  int64_t M, float* y, int64_t N) {
  using Fn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, vec*);
  static constexpr Fn tiles[TILE + 1] = {nullptr,
                                         rows_partial<type, 1>,
                                         rows_partial<type, 2>,
                                         rows_partial<type, 3>,
                                         rows_partial<type, 4>,
                                         rows_partial<type, 5>,
                                         rows_partial<type, 6>,
                                         rows_partial<type, 7>,
                                         rows_partial<type, 8>};
  if (M == 1 || K <= KB) {
    vec acc[2 * TILE];
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
        std::fill(acc, acc + 2 * t, vec{});
        tiles[t](rows + (j - lo) * row_bytes, 0, K, K, x + m0 * K, acc);
        for (int m = 0; m < t; ++m) y[(m0 + m) * N + j] = lane_sum(acc[2 * m] + acc[2 * m + 1]);
      }
    return;
  }
  std::vector<vec> acc(JB * M * 2);  // per (weight row, input row): even, odd
  for (int64_t j0 = lo; j0 < hi; j0 += JB) {
    const int64_t jn = std::min(JB, hi - j0);
    std::fill(acc.begin(), acc.end(), vec{});
    for (int64_t k0 = 0; k0 < K; k0 += KB)
      for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
        for (int64_t j = j0; j < j0 + jn; ++j)
          tiles[t](rows + (j - lo) * row_bytes, k0, std::min(KB, K - k0), K, x + m0 * K,
                   acc.data() + ((j - j0) * M + m0) * 2);
      }
    for (int64_t j = j0; j < j0 + jn; ++j)
      for (int64_t m = 0; m < M; ++m) {
        const vec* a = acc.data() + ((j - j0) * M + m) * 2;
        y[m * N + j] = lane_sum(a[0] + a[1]);
      }
  }
}

// ---- products with int8 activations (AVX512-VNNI) ---------------------------------------------
//
// The faster path, as llama.cpp multiplies its blocks: each input row is quantized to int8 per
// 32-element block (scale = max|x| / 127, values rounded to nearest even), and a weight block's
// integers are multiplied with those by vpdpbusd (u8 x s8, four products summed per 32-bit lane,
// exactly). The weights are decoded per 64 columns (a "chunk": two 32-blocks, or a quarter of a
// 256-super-block) into unsigned bytes u, with w = scale * (u - offset) + min, fp32 scales per
// lane and, for the types with a minimum, fp32 minimums per lane. Per chunk and input row, in
// 16 lanes:
//   I    = sum(u * xq) - offset * sum(xq)                  (int32, exact)
//   acc  = acc + float(I) * (weight scale * input scale)   (one rounding for the product, one for the fma)
//   macc = macc + min * (input scale * sum(xq))            (Q4_1, Q5_1)
// over the chunks in order; then one lane reduction of acc + macc. Every step depends only on the
// output's own weight row and input row, in an order fixed by K: batch-invariant as the fp32 path is.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAS_Q8 = true;

// Bytes ahead of the weight block being decoded that are prefetched: the weights are streamed once
// per forward, and a thread's rows are contiguous.
constexpr int64_t PREFETCH = 1024;
// Many input rows (prefill) go over the weights a block of rows at a time (about this many bytes,
// to stay in L2) for each tile of input rows, so the input rows are not streamed again per weight
// row. The order of the tiles changes no output's operations.
constexpr int64_t WEIGHT_BLOCK = 128 * 1024;

// Input rows quantized to int8, padded to whole chunks of 64 columns.
struct QRows {
  int64_t M = 0, K = 0, chunks = 0;
  std::vector<int8_t> q;      // (M, chunks * 64)
  std::vector<float> scale;   // (M, chunks * 16): lanes 0-7 the scale of block 2c, lanes 8-15 that of block 2c + 1
  std::vector<int32_t> sum4;  // (M, chunks * 16): per lane, the sum of its four int8 values
  std::vector<float> sum4f;   // (M, chunks * 16): the lane's scale times sum4
  std::vector<float> block_scale;  // (M, K / 32): the scale of each 32-block
  std::vector<int32_t> block_sum;  // (M, K / 32): the sum of its int8 values
};

void quantize_rows(const float* x, int64_t M, int64_t K, QRows& r) {
  r.M = M;
  r.K = K;
  r.chunks = (K + 63) / 64;
  const int64_t width = r.chunks * 64, lanes = r.chunks * 16;
  r.q.assign(M * width, 0);
  r.scale.assign(M * lanes, 0.0f);
  r.sum4.resize(M * lanes);
  r.sum4f.resize(M * lanes);
  r.block_scale.resize(M * (K / 32));
  r.block_sum.resize(M * (K / 32));
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = r.q.data() + m * width;
      float* s = r.scale.data() + m * lanes;
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + m * K + 32 * b;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtsepi32_epi8(v0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtsepi32_epi8(v1));
        for (int l = 0; l < 8; ++l) s[8 * b + l] = d;  // block b's 32 values are lanes 8b..8b+7
        r.block_scale[m * (K / 32) + b] = d;
        r.block_sum[m * (K / 32) + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));  // |v| <= 127: the bytes
      }
      const __m512i ones = _mm512_set1_epi8(1);
      for (int64_t c = 0; c < r.chunks; ++c) {
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + 64 * c));
        _mm512_storeu_si512(r.sum4.data() + m * lanes + 16 * c, sum);
        _mm512_storeu_ps(r.sum4f.data() + m * lanes + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), _mm512_cvtepi32_ps(sum)));
      }
    }
  });
}

inline __m512i nibbles(__m256i q) {  // 32 bytes -> their 32 low nibbles then their 32 high nibbles
  const __m256i low = _mm256_set1_epi8(15);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low)),
                            _mm256_and_si256(_mm256_srli_epi16(q, 4), low), 1);
}
inline __m512i nibbles_at(const uint8_t* p) {  // the same from memory: one load, one shift, one mask
  const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i shift = _mm512_mask_blend_epi64(0xF0, _mm512_setzero_si512(), _mm512_set1_epi16(4));
  return _mm512_and_si512(_mm512_srlv_epi16(q, shift), _mm512_set1_epi8(15));
}
inline __m512i lane_index(int a, int b) {  // lanes 0-7 a, lanes 8-15 b
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
}
inline __m512 lanes_of(__m512 v, int a, int b) {  // lanes 0-7 v[a], lanes 8-15 v[b]
  return _mm512_permutexvar_ps(lane_index(a, b), v);
}
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int64_t type>
constexpr int32_t offset_of() {
  return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0;
}
template <int64_t type>
constexpr bool has_min() {
  return type == Q4_1 || type == Q5_1;
}

// One chunk of two 32-blocks a and b (b absent when two is false: the row's last, odd block) of a
// legacy type: emit(c, u, scales, mins).
template <int64_t type, typename Emit>
inline void legacy_chunk(int64_t c, const uint8_t* a, const uint8_t* b, bool two, Emit& emit) {
  _mm_prefetch(reinterpret_cast<const char*>(a) + PREFETCH, _MM_HINT_T0);
  // d (and m) of both blocks at once: halves [d_a, m_a, d_b, m_b] (m only meaningful for Q4_1, Q5_1)
  const __m512 dm = _mm512_castps128_ps512(
      _mm_cvtph_ps(_mm_set_epi32(0, 0, two ? static_cast<int>(load_u32(b)) : 0, static_cast<int>(load_u32(a)))));
  __m512i q;
  if constexpr (type == Q8_0) {
    const __m256i qa = load32(a + 2), qb = two ? load32(b + 2) : _mm256_set1_epi8(-128);
    q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), _mm512_set1_epi8(-128));
  } else {
    const int head = (type == Q4_1 || type == Q5_1) ? 4 : 2;
    const int qs = (type == Q5_0 || type == Q5_1) ? head + 4 : head;
    const __m128i qa = load16(a + qs), qb = two ? load16(b + qs) : _mm_setzero_si128();
    const __m512i z = nibbles(_mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
    q = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));  // a's low, a's high, b's low, b's high nibbles
    if constexpr (type == Q5_0 || type == Q5_1) {
      const uint64_t high = load_u32(a + head) | (two ? static_cast<uint64_t>(load_u32(b + head)) << 32 : 0);
      q = _mm512_mask_add_epi8(q, static_cast<__mmask64>(high), q, _mm512_set1_epi8(16));
    }
  }
  emit(c, q, lanes_of(dm, 0, 2), has_min<type>() ? lanes_of(dm, 1, 3) : _mm512_setzero_ps());
}

// Decodes a weight row of K columns chunk by chunk, in registers, and hands each to
// emit(c, u, scales, mins): u its 64 weights as unsigned bytes, and per lane the scale and the
// minimum of the 32 or 16 weights the lane's four bytes belong to.
template <int64_t type, typename Emit>
inline void decode_chunks(const uint8_t* row, int64_t K, Emit&& emit) {
  const Layout lay = layout(type);
  const int64_t blocks = K / 32;
  int64_t c = 0;
  for (; 2 * c + 1 < blocks; ++c) {
    const uint8_t* a = row + 2 * c * lay.bytes;
    legacy_chunk<type>(c, a, a + lay.bytes, true, emit);
  }
  if (2 * c < blocks) legacy_chunk<type>(c, row + 2 * c * lay.bytes, nullptr, false, emit);
}

// One weight row times T quantized input rows (x's rows m0..m0+T-1): out[m] for each.
template <int64_t type, int T>
void q8_tile(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out) {
  const int64_t C = x.chunks;
  __m512 acc[T], macc[T];
  for (int m = 0; m < T; ++m) acc[m] = macc[m] = _mm512_setzero_ps();
  const int8_t* xq = x.q.data() + 64 * m0 * C;
  const float* xs = x.scale.data() + 16 * m0 * C;
  const float* xm = x.sum4f.data() + 16 * m0 * C;
  const int32_t* xb = bias ? bias + 16 * m0 * C : nullptr;
  decode_chunks<type>(row, x.K, [&](int64_t c, __m512i w, __m512 s, __m512 mn) {
    for (int m = 0; m < T; ++m) {
      const int64_t r = m * C + c;
      const __m512i init = offset_of<type>() ? _mm512_loadu_si512(xb + 16 * r) : _mm512_setzero_si512();
      const __m512 i = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, w, _mm512_loadu_si512(xq + 64 * r)));
      acc[m] = _mm512_fmadd_ps(i, _mm512_mul_ps(s, _mm512_loadu_ps(xs + 16 * r)), acc[m]);
      if constexpr (has_min<type>()) macc[m] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(xm + 16 * r), macc[m]);
    }
  });
  for (int m = 0; m < T; ++m) out[m] = lane_sum((vec)(has_min<type>() ? _mm512_add_ps(acc[m], macc[m]) : acc[m]));
}

// y[:, j] for j in [lo, hi) of one part, as part_outputs, from quantized input rows (bias: for the
// types with an offset, -offset * sum4 of each row).
// y[:, j] for j in [lo, hi) of one part, a weight row at a time: tile(row, m0, t, out) computes one
// row's outputs for input rows m0..m0+t-1. A thread goes over a block of weight rows (about
// WEIGHT_BLOCK bytes) for each tile of input rows, so many input rows are not streamed again per
// weight row; the order changes no output's operations.
template <typename Tile>
void row_outputs(Tile&& tile, const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, int64_t M, float* y,
                 int64_t N) {
  float out[TILE];
  const int64_t block = std::max<int64_t>(1, WEIGHT_BLOCK / row_bytes);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
      const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
      for (int64_t j = j0; j < std::min(hi, j0 + block); ++j) {
        tile(rows + (j - lo) * row_bytes, m0, t, out);
        for (int m = 0; m < t; ++m) y[(m0 + m) * N + j] = out[m];
      }
    }
}

template <int64_t type>
void part_outputs_q8(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, const QRows& x,
                     const int32_t* bias, float* y, int64_t N) {
  using Fn = void (*)(const uint8_t*, const QRows&, int64_t, const int32_t*, float*);
  static constexpr Fn tiles[TILE + 1] = {nullptr,          q8_tile<type, 1>, q8_tile<type, 2>,
                                         q8_tile<type, 3>, q8_tile<type, 4>, q8_tile<type, 5>,
                                         q8_tile<type, 6>, q8_tile<type, 7>, q8_tile<type, 8>};
  row_outputs([&](const uint8_t* row, int64_t m0, int t, float* out) { tiles[t](row, x, m0, bias, out); }, rows,
              row_bytes, lo, hi, x.M, y, N);
}
// Q4_K and Q6_K, as llama.cpp's Q8_K: an input row is quantized per 256 columns (one scale per
// super-block) and everything inside a super-block is integer, exact: per chunk of 64 columns,
// vpmaddubsw multiplies u with xq and adds pairs (16 bits, no overflow for these types), and
// vpdpwssd multiplies those pair sums by the lanes' sub-block scales and adds them to 32-bit lanes:
// lane l of a chunk gets scale * sum of its four products. Q6_K's offset (32 * scale * sum of xq
// per 16 columns) is subtracted in the same integers; Q4_K's minimums (6-bit minimum * sum of xq
// per 16 columns) are a second integer sum. Then per super-block, in order: acc = acc + float(S) *
// (d * input scale), macc = macc + float(minimums) * (-dmin * input scale) for Q4_K; one lane
// reduction of acc + macc at the end.

struct KRows {  // input rows quantized per 256 columns
  int64_t M = 0, K = 0, supers = 0;
  std::vector<int8_t> q;       // (M, K)
  std::vector<float> scale;    // (M, supers)
  std::vector<int32_t> sum16;  // (M, supers * 16): sums of the int8 values of each 16 columns
};

void quantize_rows_k(const float* x, int64_t M, int64_t K, KRows& r) {
  r.M = M;
  r.K = K;
  r.supers = K / 256;
  r.q.resize(M * K);
  r.scale.resize(M * r.supers);
  r.sum16.resize(M * r.supers * 16);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t sb = 0; sb < r.supers; ++sb) {
        const float* xb = x + m * K + 256 * sb;
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 16; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)));
        const float d = _mm512_reduce_max_ps(amax) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        r.scale[m * r.supers + sb] = d;
        int8_t* q = r.q.data() + m * K + 256 * sb;
        int32_t* s = r.sum16.data() + (m * r.supers + sb) * 16;
        for (int i = 0; i < 16; ++i) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * i), _mm512_set1_ps(id)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtsepi32_epi8(v));
          s[i] = _mm512_reduce_add_epi32(v);  // |v| <= 127: the stored bytes are v exactly
        }
      }
  });
}

// One super-block of a Q4_K or Q6_K row, decoded: four chunks of unsigned bytes, each with its lanes'
// integer scales as 16-bit pairs (scale, scale) for vpdpwssd; per 16 columns, the integer that
// multiplies the sum of xq there, as (value, 0) 16-bit pairs (Q4_K: the sub-block's 6-bit minimum;
// Q6_K: -32 * scale, the offset); d, and for Q4_K -dmin.
struct Super {
  __m512i u[4], scale[4], mins;
  float d, dmin;
};

inline __m512i pairs(__m512i v) {  // 32-bit lanes of small integers -> (v, v) as 16-bit halves
  return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
}

template <int64_t type>
inline void decode_super(const uint8_t* p, Super& s) {
  if constexpr (type == Q4_K) {
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(p))));
    s.d = _mm_cvtss_f32(dm);
    s.dmin = -_mm_cvtss_f32(_mm_movehdup_ps(dm));
    // 12 bytes of 6-bit scales and minimums (get_scale_min_k4): sub-block j < 4 has scale sc[j] & 63 and
    // minimum sc[j + 4] & 63; j >= 4 the low nibble (scale) or high nibble (minimum) of sc[j + 4] with
    // the top two bits of sc[j - 4] (scale) or sc[j] (minimum) above it. As 32-bit words w0 w1 w2:
    // scales 0-3 = w0 & 0x3f.., minimums 0-3 = w1 & 0x3f.., scales 4-7 = (w2 & 0x0f..) | ((w0 >> 6) &
    // 0x03..) << 4, minimums 4-7 = ((w2 >> 4) & 0x0f..) | ((w1 >> 6) & 0x03..) << 4; four lanes at once.
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));  // w0 w1 w2, and 4 bytes of qs
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 2, 1, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0x3f3f3f3f, 0x0f0f0f0f, 0x0f0f0f0f));
    const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 1, 0)), 6),
                                                      _mm_setr_epi32(0, 0, 0x03030303, 0x03030303)),
                                        4);
    // lanes 0-7 the scales, 8-15 the minimums
    const __m512i sm = _mm512_cvtepu8_epi32(_mm_shuffle_epi32(_mm_or_si128(low, high), _MM_SHUFFLE(3, 1, 2, 0)));
    const __m512i smp = pairs(sm);
    for (int i = 0; i < 4; ++i) {  // chunk i: sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles)
      s.u[i] = nibbles_at(p + 16 + 32 * i);
      s.scale[i] = _mm512_permutexvar_epi32(lane_index(2 * i, 2 * i + 1), smp);
    }
    // 16 columns g belong to sub-block g / 2
    s.mins = _mm512_permutexvar_epi32(
        _mm512_srli_epi32(_mm512_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31), 1), sm);
  } else {
    const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    const __m512i quarter = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    const __m512i sc = _mm512_cvtepi8_epi32(load16(p + 192));  // 16 scales, one per 16 columns
    s.d = half_to_float(p + 208);
    s.dmin = 0.0f;
    s.mins = _mm512_and_si512(_mm512_mullo_epi32(sc, _mm512_set1_epi32(-32)), _mm512_set1_epi32(0xFFFF));
    const __m512i scp = pairs(sc);
    for (int half = 0; half < 2; ++half) {
      const __m512i l = _mm512_loadu_si512(p + 64 * half);
      const __m256i h = load32(p + 128 + 32 * half);
      // bit pairs 0-1 and 2-3 of qh for weights 0-63 of the half; 4-5 and 6-7 for weights 64-127
      const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
      const __m512i h23 = _mm512_srli_epi16(h01, 4);
      s.u[2 * half] = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_slli_epi16(_mm512_and_si512(h01, three), 4));
      s.u[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                          _mm512_slli_epi16(_mm512_and_si512(h23, three), 4));
      // chunk c's lanes 4g..4g+3 take scale 4c + g
      s.scale[2 * half] = _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(8 * half)), scp);
      s.scale[2 * half + 1] = _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(8 * half + 4)), scp);
    }
  }
}

template <int64_t type, int T>
void k_tile(const uint8_t* row, const KRows& x, int64_t m0, float* out) {
  const int64_t S = x.supers;
  __m512 acc[T], macc[T];
  for (int m = 0; m < T; ++m) acc[m] = macc[m] = _mm512_setzero_ps();
  Super s;
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = row + sb * layout(type).bytes;
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 128, _MM_HINT_T0);
    decode_super<type>(p, s);
    for (int m = 0; m < T; ++m) {
      const int64_t r = (m0 + m) * S + sb;
      const int8_t* xq = x.q.data() + 256 * r;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains; integer, so exact
      for (int i = 0; i < 4; i += 2) {
        even = _mm512_dpwssd_epi32(even, _mm512_maddubs_epi16(s.u[i], _mm512_loadu_si512(xq + 64 * i)), s.scale[i]);
        odd = _mm512_dpwssd_epi32(odd, _mm512_maddubs_epi16(s.u[i + 1], _mm512_loadu_si512(xq + 64 * i + 64)),
                                  s.scale[i + 1]);
      }
      __m512i total = _mm512_add_epi32(even, odd);
      const __m512i sum16 = _mm512_loadu_si512(x.sum16.data() + 16 * r);
      const float dx = x.scale[r];
      if constexpr (type == Q6_K) total = _mm512_dpwssd_epi32(total, sum16, s.mins);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(s.d * dx), acc[m]);
      if constexpr (type == Q4_K)
        macc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), sum16, s.mins)),
                                  _mm512_set1_ps(s.dmin * dx), macc[m]);
    }
  }
  for (int m = 0; m < T; ++m) out[m] = lane_sum((vec)_mm512_add_ps(acc[m], macc[m]));
}

template <int64_t type>
void part_outputs_k(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, const KRows& x, float* y,
                    int64_t N) {
  using Fn = void (*)(const uint8_t*, const KRows&, int64_t, float*);
  static constexpr Fn tiles[TILE + 1] = {nullptr,         k_tile<type, 1>, k_tile<type, 2>, k_tile<type, 3>,
                                         k_tile<type, 4>, k_tile<type, 5>, k_tile<type, 6>, k_tile<type, 7>,
                                         k_tile<type, 8>};
  row_outputs([&](const uint8_t* row, int64_t m0, int t, float* out) { tiles[t](row, x, m0, out); }, rows, row_bytes,
              lo, hi, x.M, y, N);
}
// ---- Q4_K, eight rows interleaved (repacked at load) -------------------------------------------
//
// The same products as k_tile's, with fewer instructions per weight: the rows of a Q4_K matrix are
// regrouped eight at a time (repack_q4k_x8, once at load), so that one 64-byte vector holds four
// packed bytes (eight weights of two sub-blocks) of each of the eight rows and one vpdpbusd
// multiplies all eight rows with a broadcast of eight input bytes. The sub-block scales then apply
// once per four vpdpbusd, and the unpacking is shared by eight rows. Per output row the integer
// sums over a super-block are the same integers as k_tile's; the fp32 steps are per super-block,
// in order, as there. A group's bytes per super-block:
//   d[8], dmin[8] fp16 | scales[4][2][8] u8 (chunk i, low/high sub-block, row) | mins[8][8] u8
//   (sub-block, row) | nibbles[4][4][64] (chunk i, eight weights g: 32-bit lane 2r + h holds row r's
//   qs[32i + 8g + 4h .. +3])
constexpr int64_t X8_BYTES = 32 + 64 + 64 + 1024;
constexpr int64_t Q4_K_X8 = 112;  // the repacked layout's type id (not a GGML type)

// rows (N, K / 256 * 144) Q4_K, N a multiple of 8 -> (N / 8, K / 256 * X8_BYTES).
torch::Tensor repack_q4k_x8(torch::Tensor rows, int64_t K) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kUInt8 && rows.is_contiguous() && K % 256 == 0 &&
                  rows.size(1) == K / 256 * 144 && rows.size(0) % 8 == 0,
              "quant.repack_q4k_x8: rows must be contiguous Q4_K (N, K / 256 * 144), N a multiple of eight");
  const int64_t groups = rows.size(0) / 8, S = K / 256;
  auto out = torch::empty({groups, S * X8_BYTES}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t sb = 0; sb < S; ++sb) {
        uint8_t* o = dst + gi * S * X8_BYTES + sb * X8_BYTES;
        for (int r = 0; r < 8; ++r) {
          const uint8_t* p = src + (gi * 8 + r) * rows.size(1) + sb * 144;
          std::memcpy(o + 2 * r, p, 2);
          std::memcpy(o + 16 + 2 * r, p + 2, 2);
          const uint8_t* sc = p + 4;
          for (int j = 0; j < 8; ++j) {
            int a, e;
            scale_min_k4(sc, j, a, e);
            o[32 + (j / 2) * 16 + (j % 2) * 8 + r] = static_cast<uint8_t>(a);
            o[96 + j * 8 + r] = static_cast<uint8_t>(e);
          }
          for (int i = 0; i < 4; ++i)
            for (int g = 0; g < 4; ++g)
              for (int h = 0; h < 2; ++h)
                std::memcpy(o + 160 + (4 * i + g) * 64 + (2 * r + h) * 4, p + 16 + 32 * i + 8 * g + 4 * h, 4);
        }
      }
  });
  return out;
}

constexpr int X8_TILE = 4;

inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// One group of eight weight rows times T quantized input rows (x's rows m0..m0+T-1): out[m][r].
template <int T>
void x8_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[8]) {
  const int64_t S = x.supers;
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[T];
  __m256 macc[T];
  for (int m = 0; m < T; ++m) {
    acc[m] = _mm512_setzero_ps();
    macc[m] = _mm256_setzero_ps();
  }
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * X8_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(p) + X8_BYTES * 2, _MM_HINT_T0);
    __m512i total[T];
    for (int m = 0; m < T; ++m) total[m] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      // the sub-block scales of rows 0-7, each for the row's two lanes
      const __m512i sl = _mm512_permutexvar_epi32(dup, _mm512_cvtepu8_epi32(load8(p + 32 + 16 * i)));
      const __m512i sh = _mm512_permutexvar_epi32(dup, _mm512_cvtepu8_epi32(load8(p + 40 + 16 * i)));
      __m512i lo[T], hi[T];
      for (int m = 0; m < T; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        const __m512i packed = _mm512_loadu_si512(p + 160 + (4 * i + g) * 64);
        const __m512i wl = _mm512_and_si512(packed, low), wh = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        for (int m = 0; m < T; ++m) {
          const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 64 * i + 8 * g;
          int64_t a, b;
          std::memcpy(&a, xq, 8);
          std::memcpy(&b, xq + 32, 8);
          lo[m] = _mm512_dpbusd_epi32(lo[m], wl, _mm512_set1_epi64(a));
          hi[m] = _mm512_dpbusd_epi32(hi[m], wh, _mm512_set1_epi64(b));
        }
      }
      for (int m = 0; m < T; ++m)
        total[m] = _mm512_add_epi32(total[m],
                                    _mm512_add_epi32(_mm512_mullo_epi32(lo[m], sl), _mm512_mullo_epi32(hi[m], sh)));
    }
    const __m512 d = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(load16(p))));
    const __m256 dmin = _mm256_cvtph_ps(load16(p + 16));
    for (int m = 0; m < T; ++m) {
      const int64_t r = (m0 + m) * S + sb;
      const int32_t* s16 = x.sum16.data() + 16 * r;
      __m256i mins = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(load8(p + 96 + 8 * j)),
                                                         _mm256_set1_epi32(s16[2 * j] + s16[2 * j + 1])));
      // lanes 2r and 2r + 1 hold row r's two halves: both get their sum
      const __m512i t = _mm512_add_epi32(total[m], _mm512_shuffle_epi32(total[m], _MM_PERM_CDAB));
      const float dx = x.scale[r];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[m]);
      macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), macc[m]);
    }
  }
  for (int m = 0; m < T; ++m) {
    float a[16], b[8];
    _mm512_storeu_ps(a, acc[m]);
    _mm256_storeu_ps(b, macc[m]);
    for (int r = 0; r < 8; ++r) out[m][r] = a[2 * r] + b[r];
  }
}

// y[:, j] for the groups of eight rows covering [lo, hi) (multiples of 8) of one repacked part:
// tiles[t] computes a group's eight outputs for t input rows. A thread goes over a block of groups
// (about WEIGHT_BLOCK bytes) for each tile of input rows.
template <typename Rows>
void grouped_outputs(void (*const* tiles)(const uint8_t*, const Rows&, int64_t, float (*)[8]), const uint8_t* groups,
                     int64_t group_bytes, int64_t lo, int64_t hi, const Rows& x, float* y, int64_t N) {
  float out[X8_TILE][8];
  const int64_t block = std::max<int64_t>(8, WEIGHT_BLOCK / group_bytes * 8);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = 0; m0 < x.M; m0 += X8_TILE) {
      const int t = static_cast<int>(std::min<int64_t>(X8_TILE, x.M - m0));
      for (int64_t j = j0; j < std::min(hi, j0 + block); j += 8) {
        tiles[t](groups + (j - lo) / 8 * group_bytes, x, m0, out);
        for (int m = 0; m < t; ++m)
          for (int r = 0; r < 8; ++r) y[(m0 + m) * N + j + r] = out[m][r];
      }
    }
}

void part_outputs_x8(const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const KRows& x, float* y,
                     int64_t N) {
  using Fn = void (*)(const uint8_t*, const KRows&, int64_t, float (*)[8]);
  static constexpr Fn tiles[X8_TILE + 1] = {nullptr, x8_tile<1>, x8_tile<2>, x8_tile<3>, x8_tile<4>};
  grouped_outputs<KRows>(tiles, groups, group_bytes, lo, hi, x, y, N);
}
// ---- Q4_1 and Q8_0, eight rows interleaved (repacked at load) ------------------------------------
//
// As for Q4_K: the rows of a matrix are regrouped eight at a time so that one vpdpbusd multiplies
// eight output rows with a broadcast of eight input bytes. Per 32-block, a group holds d[8] fp16,
// for Q4_1 m[8] fp16, then 64-byte vectors g whose 32-bit lane 2r + h holds row r's bytes
// qs[8g + 4h .. +3]: Q4_1's packed nibbles (the low ones weights 8g + 4h.., the high ones 16 + ..),
// two vectors; Q8_0's values plus 128 (unsigned), four vectors. Per block and input row: the
// block's integer sum for each of the eight rows (Q8_0: minus 128 times the input's block sum), then
// acc = acc + float(sum) * (d * input scale), and for Q4_1 acc = acc + m * (input scale * block sum).
constexpr int64_t Q4_1_X8 = 103, Q8_0_X8 = 108;  // the repacked layouts' type ids (not GGML types)

constexpr int64_t lx8_bytes(int64_t type) { return type == Q4_1_X8 ? 16 + 16 + 128 : 16 + 256; }

// rows (N, K / 32 * block bytes) of Q4_1 or Q8_0, N a multiple of 8 -> (N / 8, K / 32 * lx8_bytes).
torch::Tensor repack_legacy_x8(torch::Tensor rows, int64_t type, int64_t K) {
  TORCH_CHECK(type == Q4_1 || type == Q8_0, "quant.repack_legacy_x8: Q4_1 or Q8_0 only");
  const Layout lay = layout(type);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kUInt8 && rows.is_contiguous() && K % 32 == 0 &&
                  rows.size(1) == K / 32 * lay.bytes && rows.size(0) % 8 == 0,
              "quant.repack_legacy_x8: rows must be contiguous (N, K / 32 * ", lay.bytes, "), N a multiple of eight");
  const int64_t xtype = type == Q4_1 ? Q4_1_X8 : Q8_0_X8, gb = lx8_bytes(xtype), groups = rows.size(0) / 8,
                B = K / 32;
  auto out = torch::empty({groups, B * gb}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t b = 0; b < B; ++b) {
        uint8_t* o = dst + (gi * B + b) * gb;
        for (int r = 0; r < 8; ++r) {
          const uint8_t* p = src + (gi * 8 + r) * rows.size(1) + b * lay.bytes;
          std::memcpy(o + 2 * r, p, 2);  // d
          if (type == Q4_1) {
            std::memcpy(o + 16 + 2 * r, p + 2, 2);  // m
            for (int g = 0; g < 2; ++g)
              for (int h = 0; h < 2; ++h) std::memcpy(o + 32 + 64 * g + (2 * r + h) * 4, p + 4 + 8 * g + 4 * h, 4);
          } else {
            for (int g = 0; g < 4; ++g)
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) o[16 + 64 * g + (2 * r + h) * 4 + i] = p[2 + 8 * g + 4 * h + i] ^ 0x80;
          }
        }
      }
  });
  return out;
}

template <int64_t xtype, int T>
void lx8_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[8]) {
  const int64_t B = x.K / 32, width = x.chunks * 64, gb = lx8_bytes(xtype);
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[T];
  for (int m = 0; m < T; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
    const __m512 d = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(load16(p))));
    __m512i w[4];
    if constexpr (xtype == Q4_1_X8) {
      const __m512i p0 = _mm512_loadu_si512(p + 32), p1 = _mm512_loadu_si512(p + 96);
      w[0] = _mm512_and_si512(p0, low);
      w[1] = _mm512_and_si512(p1, low);
      w[2] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
      w[3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
    } else {
      for (int g = 0; g < 4; ++g) w[g] = _mm512_loadu_si512(p + 16 + 64 * g);
    }
    const __m512 mins = xtype == Q4_1_X8 ? _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(load16(p + 16))))
                                         : _mm512_setzero_ps();
    for (int m = 0; m < T; ++m) {
      const int8_t* xq = x.q.data() + (m0 + m) * width + 32 * b;
      __m512i sum = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {  // Q4_1: low nibbles of vectors 0, 1 (weights 0-15), then high (16-31)
        int64_t v;
        std::memcpy(&v, xq + 8 * g, 8);
        sum = _mm512_dpbusd_epi32(sum, w[g], _mm512_set1_epi64(v));
      }
      // lanes 2r and 2r + 1 hold row r's two halves: both get their sum
      sum = _mm512_add_epi32(sum, _mm512_shuffle_epi32(sum, _MM_PERM_CDAB));
      const int64_t blk = (m0 + m) * B + b;
      if constexpr (xtype == Q8_0_X8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x.block_sum[blk]));
      const float dx = x.block_scale[blk];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[m]);
      if constexpr (xtype == Q4_1_X8)
        acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(dx * static_cast<float>(x.block_sum[blk])), acc[m]);
    }
  }
  for (int m = 0; m < T; ++m) {
    float a[16];
    _mm512_storeu_ps(a, acc[m]);
    for (int r = 0; r < 8; ++r) out[m][r] = a[2 * r];
  }
}

template <int64_t xtype>
void part_outputs_lx8(const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const QRows& x, float* y,
                      int64_t N) {
  using Fn = void (*)(const uint8_t*, const QRows&, int64_t, float (*)[8]);
  static constexpr Fn tiles[X8_TILE + 1] = {nullptr, lx8_tile<xtype, 1>, lx8_tile<xtype, 2>, lx8_tile<xtype, 3>,
                                            lx8_tile<xtype, 4>};
  grouped_outputs<QRows>(tiles, groups, group_bytes, lo, hi, x, y, N);
}
// A matrix's rows regrouped eight at a time for the int8 kernels: (the regrouped tensor, its type id)
// for Q4_K, Q4_1 and Q8_0 (rows a multiple of 8), None for the types that go a row at a time.
c10::optional<std::tuple<torch::Tensor, int64_t>> repack(torch::Tensor rows, int64_t type, int64_t K) {
  if (type == Q4_K) return std::make_tuple(repack_q4k_x8(rows, K), Q4_K_X8);
  if (type == Q4_1 || type == Q8_0)
    return std::make_tuple(repack_legacy_x8(rows, type, K), type == Q4_1 ? Q4_1_X8 : Q8_0_X8);
  return c10::nullopt;
}

// Bytes per group of eight rows of a regrouped type with K columns; 0 for the other types.
int64_t regrouped_bytes(int64_t type, int64_t K) {
  if (type == Q4_K_X8) return K / 256 * X8_BYTES;
  if (type == Q4_1_X8 || type == Q8_0_X8) return K / 32 * lx8_bytes(type);
  return 0;
}
#else
constexpr bool HAS_Q8 = false;
#endif

// x: (M, K) fp32; parts: matrices (N_p, row_bytes) uint8 of GGML types `types`, each with K columns;
// bias: (sum N_p,) fp32 or None. Returns (M, sum N_p) = x W^T + b, W the parts stacked and
// dequantized. Each output is one thread's dot product in a fixed order, so its bits do not depend
// on M, on the other rows, or on the thread count.
torch::Tensor matmul(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                     c10::optional<torch::Tensor> bias, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant.matmul: x must be (M, K) fp32");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "quant.matmul: one type per part");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> offsets{0};
  bool grouped = false;  // any part regrouped eight rows at a time: threads then take whole groups
  for (size_t p = 0; p < parts.size(); ++p) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (const int64_t group_bytes = regrouped_bytes(types[p], K)) {
      TORCH_CHECK(int8, "quant.matmul: a regrouped part needs int8 activations");
      TORCH_CHECK(K % (types[p] == Q4_K_X8 ? 256 : 32) == 0 && parts[p].dim() == 2 &&
                      parts[p].scalar_type() == torch::kUInt8 && parts[p].is_contiguous() &&
                      parts[p].size(1) == group_bytes,
                  "quant.matmul: part ", p, " must be repack's (N / 8, ", group_bytes, ")");
      offsets.push_back(offsets.back() + 8 * parts[p].size(0));
      grouped = true;
      continue;
    }
#endif
    const Layout lay = layout(types[p]);
    TORCH_CHECK(K % lay.block == 0, "quant.matmul: K = ", K, " is not a multiple of the block size ", lay.block);
    TORCH_CHECK(parts[p].dim() == 2 && parts[p].scalar_type() == torch::kUInt8 && parts[p].is_contiguous() &&
                    parts[p].size(1) == K / lay.block * lay.bytes,
                "quant.matmul: part ", p, " must be contiguous uint8 (N, ", K / lay.block * lay.bytes, ")");
    offsets.push_back(offsets.back() + parts[p].size(0));
  }
  const int64_t N = offsets.back();
  for (int64_t o : offsets)
    TORCH_CHECK(!grouped || o % 8 == 0, "quant.matmul: with a regrouped part, every part's rows must come in eights");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
                "quant.matmul: bias must be contiguous fp32 (", N, ",)");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(!int8 || HAS_Q8, "quant.matmul: int8 activations need AVX512-VNNI (see int8_available())");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  QRows qx;
  std::vector<std::vector<int32_t>> biases(129);  // by offset: -offset * sum4, row after row
  KRows kx;
  bool legacy = false, super = false;
  for (int64_t t : types) (t == Q4_K || t == Q6_K || t == Q4_K_X8 ? super : legacy) |= t != F32;
  if (int8 && super) quantize_rows_k(xp, M, K, kx);
  if (int8 && legacy) {
    quantize_rows(xp, M, K, qx);
    for (int64_t t : types) if (!regrouped_bytes(t, K)) dispatch(t, [&]<int64_t type>() {
        constexpr int32_t o = offset_of<type>();
        if (type == F32 || o == 0 || !biases[o].empty()) return;
        biases[o].resize(qx.sum4.size());
        for (size_t i = 0; i < qx.sum4.size(); ++i) biases[o][i] = -o * qx.sum4[i];
      });
  }
#endif
  const int64_t unit = grouped ? 8 : 1;  // rows a thread takes together
  at::parallel_for(0, N / unit, 16 / unit, [&](int64_t begin_unit, int64_t end_unit) {
    const int64_t begin = begin_unit * unit, end = end_unit * unit;
    for (size_t p = 0; p < parts.size(); ++p) {
      const int64_t lo = std::max(begin, offsets[p]), hi = std::min(end, offsets[p + 1]);
      if (lo >= hi) continue;
      const int64_t row_bytes = parts[p].size(1);
      const uint8_t* rows = parts[p].data_ptr<uint8_t>() + (lo - offsets[p]) * row_bytes;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      const uint8_t* groups = parts[p].data_ptr<uint8_t>() + (lo - offsets[p]) / 8 * row_bytes;  // regrouped parts
      if (types[p] == Q4_1_X8)
        part_outputs_lx8<Q4_1_X8>(groups, row_bytes, lo, hi, qx, yp, N);
      else if (types[p] == Q8_0_X8)
        part_outputs_lx8<Q8_0_X8>(groups, row_bytes, lo, hi, qx, yp, N);
      else if (types[p] == Q4_K_X8)
        part_outputs_x8(groups, row_bytes, lo, hi, kx, yp, N);
      else
#endif
      dispatch(types[p], [&]<int64_t t>() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if constexpr (t == Q4_K || t == Q6_K) {
          if (int8) {
            part_outputs_k<t>(rows, row_bytes, lo, hi, kx, yp, N);
            return;
          }
        } else if constexpr (t != F32) {
          if (int8) {
            constexpr int32_t o = offset_of<t>();
            part_outputs_q8<t>(rows, row_bytes, lo, hi, qx, o ? biases[o].data() : nullptr, yp, N);
            return;
          }
        }
#endif
        part_outputs<t>(rows, row_bytes, lo, hi, K, xp, M, yp, N);
      });
      if (b)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = lo; j < hi; ++j) yp[m * N + j] += b[j];
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
// general loop's operations with the accumulators held in registers.
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

// The weights of one Llama/Qwen2 decoder layer, built once at load, so that a forward passes the
// whole stack in one call without converting its tensors again. Each projection is a list of parts
// with their GGML types (q, k, v rows stacked, with their bias or None; gate rows then up rows).
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
// attention of each segment over its own cache (keys[r], values[r]: (KVH, capacity, D)). h (rows, d)
// fp32 is updated in place. rope: the rope_table (2, rows, D/2) of every row's position.
void decoder_layer(torch::Tensor& h, const Layer& w, const std::vector<Segment>& segments,
                   const std::vector<torch::Tensor*>& keys, const std::vector<torch::Tensor*>& values,
                   const torch::Tensor& rope, int64_t H, double eps, bool int8) {
  const int64_t rows = h.size(0);
  auto t = matmul(rms_norm(h, w.norm_in, eps), w.qkv, w.qkv_types, w.qkv_bias, int8);  // (rows, (H + 2 KVH) D)
  const int64_t KVH = keys[0]->size(0), D = keys[0]->size(2), stride = t.size(1);
  TORCH_CHECK(H % KVH == 0 && stride == (H + 2 * KVH) * D, "quant.layers: qkv rows do not match the heads");
  float* tp = t.data_ptr<float>();
  rope_rows(tp, rows, stride, H + KVH, D, rope);
  auto a = torch::empty({rows, H * D}, h.options());
  std::vector<Attention> attentions;
  for (size_t r = 0; r < segments.size(); ++r) {
    const Segment& seg = segments[r];
    torch::Tensor &k_cache = *keys[r], &v_cache = *values[r];
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == KVH && k_cache.size(2) == D,
                "quant.layers: caches must be contiguous (", KVH, ", capacity, ", D, ")");
    const int64_t cap = k_cache.size(1);
    TORCH_CHECK(seg.start + seg.n <= cap, "quant.layers: the cache is too short");
    float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
    const float* rows_r = tp + seg.offset * stride;
    for (int64_t i = 0; i < seg.n; ++i)
      for (int64_t g = 0; g < KVH; ++g) {
        std::memcpy(kp + (g * cap + seg.start + i) * D, rows_r + i * stride + (H + g) * D, D * sizeof(float));
        std::memcpy(vp + (g * cap + seg.start + i) * D, rows_r + i * stride + (H + KVH + g) * D, D * sizeof(float));
      }
    float* out = a.data_ptr<float>() + seg.offset * H * D;
    attentions.push_back({rows_r, stride, seg.n, kp, vp, cap, seg.start, seg.mask, out});
  }
  attend_all(attentions, H, D, KVH, 1.0f / std::sqrt(static_cast<float>(D)));
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

// The long-running functions release the GIL (as torch's own ops do), so that a server's other
// threads (its HTTP event loop) run while a forward computes; they touch no Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x W^T (+ b) over GGML-quantized weight parts, batch-invariant",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("parts"), py::arg("types"),
        py::arg("bias") = py::none(), py::arg("int8") = false);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("repack", &repack, "(rows regrouped eight at a time for the int8 path, their type); None for other types",
        py::arg("rows"), py::arg("type"), py::arg("K"));
#endif
  m.def("release", [](torch::Tensor t) {
        // Drops this process's mapping of the whole pages inside a memory-mapped tensor (they stay in the
        // page cache and fault back in if read again): resident memory after the tensor was repacked.
        const uintptr_t page = sysconf(_SC_PAGESIZE), start = reinterpret_cast<uintptr_t>(t.data_ptr());
        const uintptr_t lo = (start + page - 1) / page * page, hi = (start + t.nbytes()) / page * page;
        if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
      }, "drop the resident pages of a memory-mapped tensor (never call it on other memory)");
  m.def("int8_available", []() { return HAS_Q8; }, "whether this build multiplies with int8 activations (AVX512-VNNI)");
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGML-quantized matrix as fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm per row");
  m.def("swiglu", &swiglu, "silu(gate) * up");
  m.def("rope_table", &rope_table, "cos and sin of the rotary angles at positions");
  m.def("rope", &rope, "rotary embedding in place, rotate-half layout");
  m.def("attention", &attention, "causal or masked attention over a KV cache, one task per position and head",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Layer, std::shared_ptr<Layer>>(m, "Layer", "the weights of one Llama/Qwen2 decoder layer")
      .def(py::init([](torch::Tensor norm_in, torch::Tensor norm_post, std::vector<torch::Tensor> qkv,
                       std::vector<int64_t> qkv_types, c10::optional<torch::Tensor> qkv_bias,
                       std::vector<torch::Tensor> o, std::vector<int64_t> o_types, std::vector<torch::Tensor> gate_up,
                       std::vector<int64_t> gate_up_types, std::vector<torch::Tensor> down,
                       std::vector<int64_t> down_types) {
             return std::make_shared<Layer>(Layer{norm_in, norm_post, qkv, o, gate_up, down, qkv_types, o_types,
                                                  gate_up_types, down_types, qkv_bias});
           }),
           py::arg("norm_in"), py::arg("norm_post"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_types"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"),
           py::arg("down_types"));
  m.def("layers", &layers, "the decoder stack over one or more requests' new positions, h updated in place",
        py::call_guard<py::gil_scoped_release>(), py::arg("h"), py::arg("stack"), py::arg("keys"), py::arg("values"),
        py::arg("starts"), py::arg("counts"),
        py::arg("rope"), py::arg("masks"), py::arg("H"), py::arg("eps"), py::arg("int8"), py::arg("taps"),
        py::arg("features"));
}

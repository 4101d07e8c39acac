// int8 activations on AVX2 without VNNI: the input rows' rounding, and the kernels of int8.h's interface,
// which are int8_halves.h's. Each 16-lane step of the VNNI kernels runs as two 8-lane halves (a 64-column
// chunk's first 32 columns are lanes 0-7, the next 32 lanes 8-15), vpdpbusd's four products per 32-bit
// lane as vpmaddubsw then vpmaddwd: the same integers, the same fp32 steps lane by lane, so the bits of
// the VNNI build's row-at-a-time kernels (tests/test_isa.py).
#pragma once

#include "int8_halves.h"

#if defined(SPECDEC_AVX2_INT8)
namespace {

inline float max_abs(const float* x, int n) {  // max |x_i| over n values, n a multiple of 8
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// 32 values of x times id, rounded to the nearest integer (ties to even) and stored as int8 at q (they
// lie in [-127, 127], so the saturating packs never act); sum16, where given, gets the sums of the
// first and the second 16.
inline void round_32(const float* x, float id, int8_t* q, int32_t* sum16) {
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(id)));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  // the packs interleave 128-bit lanes: dword k holds values 4k..4k+3 after this permutation
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  if (sum16) {
    sum16[0] = total(_mm256_add_epi32(v[0], v[1]));
    sum16[1] = total(_mm256_add_epi32(v[2], v[3]));
  }
}

void quantize_rows(const float* x, int64_t M, int64_t K, QRows& r, bool per_lane) {
  r.reset(M, K, per_lane);
  const int64_t width = r.chunks * 64, lanes = r.chunks * 16;
  r.block_scale.resize(M * (K / 32));
  r.block_sum.resize(M * (K / 32));
  r.block_scaled_sum.resize(M * (K / 32));
  for (auto& o : r.offset_sum) o.resize(M * (K / 32));
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {  // block b: lanes 8b..8b+7 of the row
        const float* xb = x + m * K + 32 * b;
        const float d = max_abs(xb, 32) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t* q = r.q.data() + m * width + 32 * b;
        int32_t sum16[2];
        round_32(xb, id, q, sum16);
        r.set_block(m * (K / 32) + b, d, sum16[0] + sum16[1]);
        if (!per_lane) continue;
        const int64_t at = m * lanes + 8 * b;
        const __m256i sum4 = dot4(_mm256_set1_epi8(1), load32(reinterpret_cast<const uint8_t*>(q)), ones);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.sum4.data() + at), sum4);
        _mm256_storeu_ps(r.scale.data() + at, _mm256_set1_ps(d));
        _mm256_storeu_ps(r.sum4f.data() + at, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sum4)));
      }
  });
}

template <int64_t type, int T>
void q8_tile(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out) {
  q8_halves<type, T>(row, x, m0, bias, out);
}

void quantize_rows_k(const float* x, int64_t M, int64_t K, KRows& r) {
  r.resize(M, K);
  r.pair32.resize(M * r.supers * 4);
  r.offset16.resize(M * r.supers * 16);
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t sb = 0; sb < r.supers; ++sb) {
        const float* xb = x + m * K + 256 * sb;
        const float d = max_abs(xb, 256) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        r.scale[m * r.supers + sb] = d;
        int32_t* s = r.sum16.data() + (m * r.supers + sb) * 16;
        for (int i = 0; i < 8; ++i) round_32(xb + 32 * i, id, r.q.data() + m * K + 256 * sb + 32 * i, s + 2 * i);
        r.set_pairs(m * r.supers + sb);
        const int8_t* q = r.q.data() + m * K + 256 * sb;
        for (int j = 0; j < 16; ++j) {  // |each half| <= 32 * 8 * 127: 16 bits
          int32_t even = 0, odd = 0;
          for (int c = 0; c < 16; c += 4) {
            even += q[16 * j + c] + q[16 * j + c + 1];
            odd += q[16 * j + c + 2] + q[16 * j + c + 3];
          }
          r.offset16[(m * r.supers + sb) * 16 + j] =
              static_cast<int32_t>((static_cast<uint32_t>(32 * even) & 0xFFFF) | (static_cast<uint32_t>(32 * odd) << 16));
        }
      }
  });
}

template <int64_t type, int T>
void k_tile(const uint8_t* row, const KRows& x, int64_t m0, float* out) {
  k_halves<type, T>(row, x, m0, out);
}

}  // namespace
#endif

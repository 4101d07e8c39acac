// Products with int8 activations on AVX2 without VNNI, a weight row at a time (the scheme: int8.h).
//
// Each 16-lane step of the VNNI kernels runs as two 8-lane halves: a 64-column chunk's first 32
// columns (one 32-block, or the first half of a K-quant chunk) are lanes 0-7, the next 32 lanes 8-15.
// vpdpbusd's four products per 32-bit lane become vpmaddubsw (u8 x s8, pairs summed to 16 bits) then
// vpmaddwd (pairs of those, times 1 or a sub-block scale, to 32 bits): the same integers as long as no
// pair saturates 16 bits, which holds for weights of at most 6 bits against |xq| <= 127 (2 * 63 * 127).
// Q8_0's weights take 8 bits with a sign, so it multiplies |w| by xq with w's sign (2 * 128 * 127 <
// 2^15) and needs no offset: the same I = sum(w * xq) as VNNI's sum(u * xq) - 128 * sum(xq).
#pragma once

#include "int8_k8.h"

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

inline int32_t total(__m256i v) {  // the sum of 8 int32 lanes (exact in any order)
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
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
  r.M = M;
  r.K = K;
  r.chunks = (K + 63) / 64;
  const int64_t width = r.chunks * 64, lanes = r.chunks * 16;
  r.q.assign(M * width, 0);
  r.scale.assign(M * lanes, 0.0f);  // the row-at-a-time kernels are the only ones here: always per lane
  r.sum4.assign(M * lanes, 0);
  r.sum4f.assign(M * lanes, 0.0f);
  (void)per_lane;
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {  // block b: lanes 8b..8b+7 of the row
        const float* xb = x + m * K + 32 * b;
        const float d = max_abs(xb, 32) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t* q = r.q.data() + m * width + 32 * b;
        round_32(xb, id, q, nullptr);
        const int64_t at = m * lanes + 8 * b;
        const __m256i sum4 = dot4(_mm256_set1_epi8(1), load32(reinterpret_cast<const uint8_t*>(q)), ones);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.sum4.data() + at), sum4);
        _mm256_storeu_ps(r.scale.data() + at, _mm256_set1_ps(d));
        _mm256_storeu_ps(r.sum4f.data() + at, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sum4)));
      }
  });
}

// 32 bits -> 32 bytes, byte i 16 where bit i is set, else 0 (the fifth bit of Q5_0 and Q5_1).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i: byte i / 8 of bits
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// A legacy 32-block's weights as 32 bytes, in order: unsigned u for the 4- and 5-bit types, Q8_0's
// signed values as they are.
template <int64_t type>
inline __m256i block_bytes(const uint8_t* block) {
  if constexpr (type == Q8_0) {
    return load32(block + 2);
  } else {
    constexpr int head = has_min<type>() ? 4 : 2;
    constexpr int qs = (type == Q5_0 || type == Q5_1) ? head + 4 : head;
    const __m128i q = load16(block + qs);  // low nibbles weights 0-15, high nibbles 16-31
    const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
    if constexpr (type == Q5_0 || type == Q5_1) return _mm256_or_si256(u, fifth_bits(load_u32(block + head)));
    return u;
  }
}

template <int64_t type, int T>
void q8_tile(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out) {
  const int64_t C = x.chunks, bytes = layout(type).bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T][2], macc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = macc[m][0] = macc[m][1] = _mm256_setzero_ps();
  // block b is lanes 8h..8h+7 of chunk b / 2, h = b % 2: the halves as constants, so acc stays in registers
  const auto block_step = [&](int64_t b, auto h) {
    const uint8_t* block = row + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    const __m256i w = block_bytes<type>(block);
    const __m256i u = type == Q8_0 ? _mm256_sign_epi8(w, w) : w;  // Q8_0: |w| (-128 reads as 128 unsigned)
    for (int m = 0; m < T; ++m) {
      const int64_t lane = 16 * C * (m0 + m) + 8 * b;  // this block's 8 lanes in the input row (chunk b / 2, half h)
      __m256i xq = load32(reinterpret_cast<const uint8_t*>(x.q.data()) + 4 * lane);
      if constexpr (type == Q8_0) xq = _mm256_sign_epi8(xq, w);
      __m256i i = dot4(u, xq, ones);
      if constexpr (offset_of<type>() != 0 && type != Q8_0)
        i = _mm256_add_epi32(i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + lane)));
      acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(x.scale.data() + lane)), acc[m][h]);
      if constexpr (has_min<type>())
        macc[m][h] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block + 2)), _mm256_loadu_ps(x.sum4f.data() + lane),
                                     macc[m][h]);
    }
  };
  const int64_t blocks = x.K / 32;
  for (int64_t b = 0; b + 1 < blocks; b += 2) {
    block_step(b, std::integral_constant<int, 0>{});
    block_step(b + 1, std::integral_constant<int, 1>{});
  }
  if (blocks % 2) block_step(blocks - 1, std::integral_constant<int, 0>{});
  for (int m = 0; m < T; ++m) {
    Float16 s;
    for (int h = 0; h < 2; ++h) s.h[h] = has_min<type>() ? _mm256_add_ps(acc[m][h], macc[m][h]) : acc[m][h];
    out[m] = lane_sum(s.v);
  }
}

void quantize_rows_k(const float* x, int64_t M, int64_t K, KRows& r) {
  r.M = M;
  r.K = K;
  r.supers = K / 256;
  r.q.resize(M * K);
  r.scale.resize(M * r.supers);
  r.sum16.resize(M * r.supers * 16);
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t sb = 0; sb < r.supers; ++sb) {
        const float* xb = x + m * K + 256 * sb;
        const float d = max_abs(xb, 256) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        r.scale[m * r.supers + sb] = d;
        int32_t* s = r.sum16.data() + (m * r.supers + sb) * 16;
        for (int i = 0; i < 8; ++i) round_32(xb + 32 * i, id, r.q.data() + m * K + 256 * sb + 32 * i, s + 2 * i);
      }
  });
}

template <int64_t type, int T>
void k_tile(const uint8_t* row, const KRows& x, int64_t m0, float* out) {
  k8_tile<type, T>(row, x, m0, out);
}

}  // namespace
#endif

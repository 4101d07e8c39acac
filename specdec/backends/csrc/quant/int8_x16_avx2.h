// Products with int8 activations over weight rows regrouped sixteen at a time at load (regroup.h), on AVX2
// without VNNI: the 32-weight types and Q4_K, and (here only) IQ4_NL and IQ4_XS. Q6_K goes a row at a time here:
// its sixteen decoded vectors do not fit AVX2's sixteen registers, and its regrouped kernel was slower than the
// row-at-a-time one on a large matrix. A group's 64-byte vectors are two 32-byte halves of eight rows each (lanes
// 0-7: rows 8h..8h+7); each half goes through a block on its own. vpdpbusd's four products per 32-bit lane become
// vpmaddubsw (16-bit pairs) then vpmaddwd (with ones, or with the sub-block's scale in both halves of each lane):
// the same integers, and every fp32 step is regroup.h's, lane by lane, so the bits are the VNNI build's
// (tests/test_isa.py).
//
// No 16-bit sum saturates: unsigned weights of up to 4 bits against |xq| <= 127 give pairs up to 2 * 15 * 127, and
// eight such vpmaddubsw results add up to 30480 < 2^15 before one vpmaddwd; 5-bit weights (Q5_0, Q5_1) go four at
// a time; Q8_0's and the IQ4 types' signed weights go as |w| times xq with w's sign (pairs up to 2 * 128 * 127),
// each product widened at once.
#pragma once

#include "int8_avx2.h"
#include "regroup.h"

#if defined(SPECDEC_AVX2_INT8)
namespace {

inline __m256i bcast4(const int8_t* xq) { return _mm256_set1_epi32(load_i32(xq)); }  // xq[0..3] in every lane
inline __m256i pairs8(__m256i v) {  // 32-bit lanes of small integers -> (v, v) as 16-bit halves
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
template <int T>
inline void store_halves(const __m256 (&acc)[T][2], float (*out)[GROUP]) {  // each input row's 16 outputs
  for (int m = 0; m < T; ++m) {
    _mm256_storeu_ps(out[m], acc[m][0]);
    _mm256_storeu_ps(out[m] + 8, acc[m][1]);
  }
}
inline __m256 halves_fp16(const uint8_t* p) {  // eight fp16 values -> fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// I = sum(w * xq) over one 32-block of half h of a group (q: the block's bytes after d and m), eight rows: xq the
// input row's 32 int8 values, init its offset term.
template <int64_t type>
inline __m256i legacy_sums8(const uint8_t* q, int h, const int8_t* xq, __m256i init) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (type == IQ4_NL) {  // the levels of the codes: signed, as Q8_0's
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
    for (int g = 0; g < 4; ++g) {
      const __m256i packed = load32(q + 64 * g + 32 * h);
      for (int c = 0; c < 2; ++c) {  // low nibbles weights 4g.., high nibbles 16 + 4g..
        const __m256i codes = _mm256_and_si256(c ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(15));
        const __m256i w = _mm256_shuffle_epi8(levels, codes);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xq + 4 * (g + 4 * c)), w));
        init = _mm256_add_epi32(init, _mm256_madd_epi16(p, ones));
      }
    }
    return init;
  } else if constexpr (type == Q8_0) {
    for (int v = 0; v < 8; ++v) {
      const __m256i w = load32(q + 64 * v + 32 * h);
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xq + 4 * v), w));
      init = _mm256_add_epi32(init, _mm256_madd_epi16(p, ones));
    }
    return init;
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    const uint8_t* qs = q + (five_bit<type>() ? 64 : 0);
    __m256i u[8];
    for (int g = 0; g < 4; ++g) {
      const __m256i packed = load32(qs + 64 * g + 32 * h);
      u[g] = _mm256_and_si256(packed, low);
      u[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if constexpr (five_bit<type>()) {  // bit v of the plane's byte: weight 4v + i's fifth bit, as 16
      const __m256i plane = load32(q + 32 * h), sixteen = _mm256_set1_epi8(16);
      u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(plane, 4), sixteen));
      u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(plane, 3), sixteen));
      u[2] = _mm256_or_si256(u[2], _mm256_and_si256(_mm256_slli_epi16(plane, 2), sixteen));
      u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_slli_epi16(plane, 1), sixteen));
      u[4] = _mm256_or_si256(u[4], _mm256_and_si256(plane, sixteen));
      u[5] = _mm256_or_si256(u[5], _mm256_and_si256(_mm256_srli_epi16(plane, 1), sixteen));
      u[6] = _mm256_or_si256(u[6], _mm256_and_si256(_mm256_srli_epi16(plane, 2), sixteen));
      u[7] = _mm256_or_si256(u[7], _mm256_and_si256(_mm256_srli_epi16(plane, 3), sixteen));
    }
    constexpr int run = five_bit<type>() ? 4 : 8;  // vpmaddubsw results summed in 16 bits
    for (int v0 = 0; v0 < 8; v0 += run) {
      __m256i s = _mm256_maddubs_epi16(u[v0], bcast4(xq + 4 * v0));
      for (int v = v0 + 1; v < v0 + run; ++v) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[v], bcast4(xq + 4 * v)));
      init = _mm256_add_epi32(init, _mm256_madd_epi16(s, ones));
    }
    return init;
  }
}

template <int64_t type, int T>
void legacy_x16_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[GROUP]) {
  constexpr int64_t gb = legacy_group_bytes<type>();
  constexpr int head = has_min<type>() ? 64 : 32;
  const int64_t B = x.K / 32, width = x.chunks * 64;
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    fetch_lines(p, gb, AHEAD_BLOCKS * gb);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = halves_fp16(p + 16 * h);
      const __m256 mn = has_min<type>() ? halves_fp16(p + 32 + 16 * h) : _mm256_setzero_ps();
      for (int m = 0; m < T; ++m) {
        const int64_t blk = (m0 + m) * B + b;
        constexpr int32_t offset = type == Q8_0 ? 0 : offset_of<type>();  // Q8_0: w itself, signed
        const __m256i init =
            offset ? _mm256_set1_epi32(x.offset_sum[offset_index(offset)][blk]) : _mm256_setzero_si256();
        const __m256i i = legacy_sums8<type>(p + head, h, x.q.data() + (m0 + m) * width + 32 * b, init);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_set1_ps(x.block_scale[blk])), acc[m][h]);
        if constexpr (has_min<type>()) acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.block_scaled_sum[blk]), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

// Q4_K: per super-block and half, sub-block j's 32 weights of eight rows are eight vectors of packed nibbles
// (chunk j / 2's, low or high nibbles); their vpmaddubsw results add up in 16 bits, and one vpmaddwd with the rows'
// scales gives scale_j * sum_j(u * xq) per row. The minimums: vpmaddwd of the rows' (min 2i, min 2i + 1) pairs with
// the input's two 32-column sums (KRows::pair32).
template <int T>
void q4k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  const int64_t S = x.supers;
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * Q4_K_GROUP_BYTES;
    constexpr int64_t ahead = AHEAD_SUPERS * Q4_K_GROUP_BYTES;  // lines fetched as the first half reads its own
    fetch_lines(p, 320, ahead);  // d, dmin, the scales and minimums
    for (int h = 0; h < 2; ++h) {
      __m256i total[T], mn[T];
      for (int m = 0; m < T; ++m) total[m] = mn[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2, low (j even) or high nibbles
        __m256i u[8];
        for (int g = 0; g < 8; ++g) {
          if (h == 0 && j % 2 == 0) fetch_lines(p + 320 + 512 * (j / 2) + 64 * g, 64, ahead);
          const __m256i packed = load32(p + 320 + 512 * (j / 2) + 64 * g + 32 * h);
          u[g] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, low);
        }
        const __m256i scale = pairs8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64 + 16 * j + 8 * h))));
        for (int m = 0; m < T; ++m) {
          const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 32 * j;
          __m256i s = _mm256_maddubs_epi16(u[0], bcast4(xq));
          for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[g], bcast4(xq + 4 * g)));
          total[m] = _mm256_add_epi32(total[m], _mm256_madd_epi16(s, scale));
        }
      }
      const __m256 d = halves_fp16(p + 16 * h), dmin = halves_fp16(p + 32 + 16 * h);
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        for (int i = 0; i < 4; ++i) {
          const __m256i mins = _mm256_cvtepu8_epi16(load16(p + 192 + 32 * i + 16 * h));
          mn[m] = _mm256_add_epi32(mn[m], _mm256_madd_epi16(mins, _mm256_set1_epi32(x.pair32[4 * r + i])));
        }
        const float dx = x.scale[r];
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[m]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn[m]), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

// IQ4_XS: per super-block and half, sub-block j's codes of eight rows become their signed levels (vpshufb), multiplied
// as |level| times xq with the level's sign; each vpmaddubsw result (pairs up to 2 * 127 * 127) goes straight into
// vpmaddwd with the rows' sub-block scales (|scale - 32| <= 32).
template <int T>
void iq4xs_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  const int64_t S = x.supers;
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * IQ4_XS_GROUP_BYTES;
    constexpr int64_t ahead = AHEAD_SUPERS * IQ4_XS_GROUP_BYTES;  // lines fetched as the first half reads its own
    fetch_lines(p, 160, ahead);  // d and the scales
    for (int h = 0; h < 2; ++h) {
      __m256i total[T];
      for (int m = 0; m < T; ++m) total[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i w[8];  // weights 4v..4v+3 of sub-block j: v = g (low nibbles), g + 4 (high)
        for (int g = 0; g < 4; ++g) {
          if (h == 0) fetch_lines(p + 160 + 256 * j + 64 * g, 64, ahead);
          const __m256i packed = load32(p + 160 + 256 * j + 64 * g + 32 * h);
          w[g] = _mm256_shuffle_epi8(levels, _mm256_and_si256(packed, low));
          w[g + 4] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
        }
        const __m256i scale = pairs8(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 16 * j + 8 * h))));
        for (int m = 0; m < T; ++m) {
          const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 32 * j;
          for (int v = 0; v < 8; ++v) {
            const __m256i pr = _mm256_maddubs_epi16(_mm256_sign_epi8(w[v], w[v]), _mm256_sign_epi8(bcast4(xq + 4 * v), w[v]));
            total[m] = _mm256_add_epi32(total[m], _mm256_madd_epi16(pr, scale));
          }
        }
      }
      const __m256 d = halves_fp16(p + 16 * h);
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[m]), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r])), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

}  // namespace
#endif

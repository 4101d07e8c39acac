// Products with int8 activations on AVX512-VNNI, a weight row at a time (the scheme: int8.h).
#pragma once

#include "int8.h"

#if defined(SPECDEC_VNNI)
namespace {

void quantize_rows(const float* x, int64_t M, int64_t K, QRows& r, bool per_lane) {
  r.reset(M, K, per_lane);
  const int64_t width = r.chunks * 64, lanes = r.chunks * 16;
  r.block_scale.resize(M * (K / 32));
  r.block_sum.resize(M * (K / 32));
  r.block_scaled_sum.resize(M * (K / 32));
  for (auto& o : r.offset_sum) o.resize(M * (K / 32));
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = r.q.data() + m * width;
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + m * K + 32 * b;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtsepi32_epi8(v0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtsepi32_epi8(v1));
        if (per_lane)  // block b's 32 values are lanes 8b..8b+7
          for (int l = 0; l < 8; ++l) r.scale[m * lanes + 8 * b + l] = d;
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));  // |v| <= 127: the bytes
        r.set_block(m * (K / 32) + b, d, sum);
      }
      const __m512i ones = _mm512_set1_epi8(1);
      for (int64_t c = 0; per_lane && c < r.chunks; ++c) {
        const int64_t at = m * lanes + 16 * c;
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + 64 * c));
        _mm512_storeu_si512(r.sum4.data() + at, sum);
        _mm512_storeu_ps(r.sum4f.data() + at, _mm512_mul_ps(_mm512_loadu_ps(r.scale.data() + at), _mm512_cvtepi32_ps(sum)));
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

void quantize_rows_k(const float* x, int64_t M, int64_t K, KRows& r) {
  r.resize(M, K);
  r.pair32.resize(M * r.supers * 4);
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
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
        r.set_pairs(m * r.supers + sb);
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

}  // namespace
#endif

// Products with int8 activations over weight rows regrouped at load (AVX512-VNNI).
#pragma once

#include "int8.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

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

}  // namespace
#endif

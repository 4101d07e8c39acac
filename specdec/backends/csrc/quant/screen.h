// A Q8_0 output layer's argmax for greedy decoding from about half its bytes: a 4-bit screen of every row,
// then the exact logits of the few rows the screen cannot rule out.
#pragma once

#include "int8_halves.h"
#include "regroup.h"

#include <atomic>
#include <tuple>

#if defined(SPECDEC_INT8)
namespace {

// ---- the screen ----------------------------------------------------------------------------------
//
// A Q8_0 weight is d * q, q in [-128, 127]. Write q + 128 = 16 hi + lo (hi, lo in 0..15): q = 16 hi - 120.5 +
// (lo - 7.5). The screen keeps hi, as the int8 kernels' regrouped Q4_0 layout with scale d1 = 16 d (exact in
// fp16). For an input row rounded to int8 (values xq, scale dx per 32-block), the exact logit's integer per block
// is I = 16 H + L - 128 X with H = sum(hi * xq), X = sum(xq) and L = sum(lo * xq) = 7.5 X + e, |e| <= 7.5 A,
// A = sum(|xq|). So with p = d * dx, the exact logit lies within width = c * sum(p * A) of
// center = sum(p * (16 H - 120.5 X)) = sum((32 H - 241 X) * (d1 * dx / 32)) (an integer times an exact
// rescaling of d1 * dx), where c = 7.5 plus what covers fp32's roundings (screen_factor), for d >= 0 (llama.cpp's
// quantizer writes d = max|w| / 127).
//
// Per input row: the screen gives every row's center and width (screen_tile); the exact logits of the eight
// rows of largest center give a floor (the largest of them, so at most the largest exact logit); a row whose
// center + width is below the floor cannot be the argmax, and every other row (the candidates: how many on real
// prompts, docs/quantized.md) gets its exact logit, from the file's rows with the regrouped Q8_0 kernels'
// integers and fp32 steps (acc = fma(float(I), d * dx, acc) over the blocks in order): the bits of the full
// output layer. A non-candidate's entry is its center, an approximation below every candidate's.

constexpr int SCREEN_FLOOR_ROWS = 8;  // rows of largest center whose exact logits set the floor

// The bound factor c for K columns: 7.5, plus 2^-13 per block for the fp32 roundings (the screen's 2K/32
// multiply-adds, its final addition and the exact logit's K/32 multiply-adds, each at most 2^-24 of a partial
// sum <= 500 * sum(p A)).
inline double screen_factor(int64_t K) { return 7.5 + (K / 32) * 0x1p-13; }

// rows (V, K / 32 * 34) Q8_0, V a multiple of 16 -> {the screen, regrouped Q4_0 (V / 16, K / 32 * 288), c}, or
// {empty tensor, 0} for a matrix the bound does not cover (a negative, non-finite or too large scale).
std::tuple<torch::Tensor, double> q8_screen(torch::Tensor rows, int64_t K) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kUInt8 && rows.is_contiguous() && K % 32 == 0 &&
                  rows.size(1) == K / 32 * 34 && rows.size(0) % GROUP == 0,
              "quant.q8_screen: rows must be contiguous uint8 (16n, ", K / 32 * 34, ") Q8_0");
  const int64_t V = rows.size(0), B = K / 32;
  auto q40 = torch::empty({V, B * 18}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = q40.data_ptr<uint8_t>();
  std::atomic<bool> covered{true};
  at::parallel_for(0, V, 256, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v)
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* p = src + v * B * 34 + b * 34;
        uint8_t* o = dst + v * B * 18 + b * 18;
        const float d = half_to_float(p);
        if (!(d >= 0.0f && d <= 2048.0f)) covered = false;  // 16 d must be an fp16 value, exactly
        const c10::Half d1(16.0f * d);
        std::memcpy(o, &d1, 2);
        for (int j = 0; j < 16; ++j)  // weight j's hi in the low nibble, weight j + 16's in the high one
          o[2 + j] = static_cast<uint8_t>(((p[2 + j] ^ 0x80) >> 4) | ((p[18 + j] ^ 0x80) & 0xF0));
      }
  });
  if (!covered) return {torch::Tensor(), 0.0};
  return {repack_legacy<Q4_0>(q40), screen_factor(K)};
}

// The screen's inputs for one input row, per block: xq, dx / 32, -241 X and (c / 16) * dx * A (d1 times it is
// the block's width).
struct ScreenRow {
  const int8_t* xq;
  std::vector<float> dx32, width_factor;
  std::vector<int32_t> x241;
};

// Center and width of a group's sixteen rows (the screen's regrouped bytes, B blocks) for one input row.
// AVX2 instructions, which every int8 build's CPU has; the layout is the same in VNNI builds.
inline void screen_tile(const uint8_t* group, int64_t B, const ScreenRow& x, float* center, float* width) {
  constexpr int64_t gb = legacy_group_bytes<Q4_0>();
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, wacc[2] = {acc[0], acc[1]};
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    fetch_lines(p, gb, AHEAD_BLOCKS * gb);
    const int8_t* xq = x.xq + 32 * b;
    __m256i xb[8];  // xq[4v..4v+3] in every lane: weights 4g.. are low nibbles (v = g), 16 + 4g.. high (v = 4 + g)
    for (int v = 0; v < 8; ++v) xb[v] = _mm256_set1_epi32(load_i32(xq + 4 * v));
    for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: one 32-bit lane each
      __m256i s = _mm256_setzero_si256();  // 16-bit: at most 8 * 2 * 15 * 127
      for (int g = 0; g < 4; ++g) {  // vector g, lane r: row r's qs[4g..4g+3]
        const __m256i packed = load32(p + 32 + 64 * g + 32 * h);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(packed, low), xb[g]));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), xb[4 + g]));
      }
      const __m256i I = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(s, ones), 5), _mm256_set1_epi32(x.x241[b]));
      const __m256 d1 = _mm256_cvtph_ps(load16(p + 16 * h));
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(d1, _mm256_set1_ps(x.dx32[b])), acc[h]);
      wacc[h] = _mm256_fmadd_ps(d1, _mm256_set1_ps(x.width_factor[b]), wacc[h]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(center + 8 * h, acc[h]);
    _mm256_storeu_ps(width + 8 * h, wacc[h]);
  }
}

// The exact logit of Q8_0 row `row` (B blocks of 34 bytes) for input row m of x: the regrouped Q8_0 kernels'
// integers and fp32 steps, so their bits.
inline float q8_exact(const uint8_t* row, const QRows& x, int64_t m) {
  const int64_t B = x.K / 32;
  const int8_t* xq = x.q.data() + m * x.chunks * 64;
  const float* dx = x.block_scale.data() + m * B;
  const __m256i ones = _mm256_set1_epi16(1);
  float acc = 0.0f;
  for (int64_t b = 0; b < B; ++b) {
    const __m256i w = block_bytes<Q8_0>(row + 34 * b);  // |w| times xq with w's sign, as int8_halves.h
    const __m256i x = _mm256_sign_epi8(load32(reinterpret_cast<const uint8_t*>(xq + 32 * b)), w);
    const int32_t I = total(dot4(_mm256_sign_epi8(w, w), x, ones));
    acc = std::fma(static_cast<float>(I), half_to_float(row + 34 * b) * dx[b], acc);
  }
  return acc;
}

// x (M, K) fp32, screen and c from q8_screen of rows (V, K / 32 * 34) Q8_0 -> (M, V) fp32 logits whose argmax per
// row (the first, on ties) is the full output layer's, with its bits (matmul's over the regrouped rows); the
// other entries are the screen's centers. Each row's result depends on that row alone.
torch::Tensor screened_logits(torch::Tensor x, torch::Tensor screen, torch::Tensor rows, double c) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % 32 == 0,
              "quant.screened_logits: x must be (M, K) fp32, K a multiple of 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), B = K / 32, V = rows.size(0);
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == B * 34 && rows.is_contiguous() && screen.is_contiguous() &&
                  screen.size(0) * GROUP == V && screen.size(1) == B * legacy_group_bytes<Q4_0>(),
              "quant.screened_logits: screen and rows must be q8_screen's and its Q8_0 rows");
  QRows qx;
  quantize_rows(x.data_ptr<float>(), M, K, qx, false);
  std::vector<ScreenRow> in(M);
  for (int64_t m = 0; m < M; ++m) {
    in[m].xq = qx.q.data() + m * qx.chunks * 64;
    for (int64_t b = 0; b < B; ++b) {
      int32_t A = 0;
      for (int j = 0; j < 32; ++j) A += std::abs(static_cast<int32_t>(in[m].xq[32 * b + j]));
      const float dx = qx.block_scale[m * B + b];
      in[m].dx32.push_back(dx / 32.0f);  // exact: a power of two
      in[m].x241.push_back(-241 * qx.block_sum[m * B + b]);
      in[m].width_factor.push_back(static_cast<float>(c / 16.0 * dx * A));
    }
  }
  auto y = torch::empty({M, V}, x.options());
  float* out = y.data_ptr<float>();  // the centers first
  auto widths = torch::empty({M, V}, x.options());
  float* width = widths.data_ptr<float>();
  const int64_t gbytes = screen.size(1);
  at::parallel_for(0, V / GROUP, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m = 0; m < M; ++m)
        screen_tile(screen.data_ptr<uint8_t>() + g * gbytes, B, in[m], out + m * V + g * GROUP,
                    width + m * V + g * GROUP);
  });
  const uint8_t* src = rows.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m) {
    float* row = out + m * V;
    const float* wid = width + m * V;
    int64_t top[SCREEN_FLOOR_ROWS];  // the rows of largest center: their exact logits give the floor
    float least[SCREEN_FLOOR_ROWS];
    std::fill(top, top + SCREEN_FLOOR_ROWS, -1);
    std::fill(least, least + SCREEN_FLOOR_ROWS, -INFINITY);
    int smallest = 0;  // the slot of the smallest center kept
    for (int64_t v = 0; v < V; ++v)
      if (row[v] > least[smallest]) {
        least[smallest] = row[v];
        top[smallest] = v;
        smallest = static_cast<int>(std::min_element(least, least + SCREEN_FLOOR_ROWS) - least);
      }
    float floor = -INFINITY;
    for (const int64_t v : top)
      if (v >= 0) floor = std::max(floor, q8_exact(src + v * B * 34, qx, m));
    const bool finite = std::isfinite(floor);  // else (an input of inf or nan) every row is computed
    at::parallel_for(0, V / 8, 512, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> todo;  // this thread's candidates, then their exact logits, the next rows' fetched
      for (int64_t i = begin; i < end; ++i) {
        const __m256 bound = _mm256_add_ps(_mm256_loadu_ps(row + 8 * i), _mm256_loadu_ps(wid + 8 * i));
        int mask = finite ? _mm256_movemask_ps(_mm256_cmp_ps(bound, _mm256_set1_ps(floor), _CMP_GE_OQ)) : 255;
        for (; mask; mask &= mask - 1) todo.push_back(8 * i + __builtin_ctz(mask));
      }
      for (size_t i = 0; i < todo.size(); ++i) {
        if (i + 2 < todo.size()) fetch_lines(src + todo[i + 2] * B * 34, B * 34, 0);
        row[todo[i]] = q8_exact(src + todo[i] * B * 34, qx, m);
      }
    });
  }
  return y;
}

}  // namespace
#endif

// Weight rows regrouped sixteen at a time at load, for the int8 kernels of every int8 build: the layouts, repack,
// and the loop over a part's groups. The kernels that read them: int8_x16.h (AVX512-VNNI), int8_x16_avx2.h (AVX2)
// and amx.h (AMX tiles).
#pragma once

#include "int8.h"

#if defined(SPECDEC_INT8)
namespace {

// ---- sixteen weight rows interleaved ---------------------------------------------------------
//
// repack regroups a matrix's rows sixteen at a time, once at load, so that one 64-byte vector holds
// four consecutive weights (as bytes, or their packed nibbles) of each of sixteen rows: 32-bit lane
// r is row r. One vpdpbusd (AVX2: vpmaddubsw, on each 32-byte half, eight rows) multiplies every
// row's four weights by four input bytes broadcast from memory, so a block's integer sums land one
// output row per lane, and every fp32 step after them runs on all the rows' lanes at once. The
// weights' unpacking is shared by every input row of a tile. (This is also the layout of an AMX
// tile's B operand: sixteen columns of four consecutive K values a row.)
//
// Per output row, in the order of its blocks, the steps depend on its own weight row and input
// row only, and are the same on every instruction set (so a VNNI build and an AVX2 build give the
// same bits: tests/test_isa.py):
//   32-weight types: I = sum(w * xq), as sum(u * xq) - offset * sum(xq) (int32, exact),
//     acc = fma(float(I), d * dx, acc), and for the types with a minimum acc = fma(m, dx * sum(xq), acc);
//   Q4_K: per super-block T = sum over sub-blocks j of scale_j * sum_j(u * xq) and
//     Mn = sum_j min_j * sum_j(xq) (int32, exact), acc = fma(float(T), d * dx, acc),
//     then acc = fma(float(Mn), dmin * -dx, acc);
//   Q6_K: per super-block T = sum over sub-blocks j of scale_j * sum_j((u - 32) * xq), acc = fma(float(T), d * dx, acc);
//   IQ4_XS (AVX2 builds): per super-block T = sum over sub-blocks j of (scale_j - 32) * sum_j(level * xq), the same fp32 step.
// So the bits depend on neither the number of input rows nor the thread count.


constexpr int X16_TILE = 8;    // input rows per tile: each tile streams the group's weights once

template <int64_t type>
constexpr bool five_bit() {
  return type == Q5_0 || type == Q5_1;
}

// AVX2 builds lay two things out their own way (vpmaddubsw multiplies unsigned by signed bytes in 16-bit pairs,
// and has no masked byte add): Q8_0's weights as the signed bytes they are, and the fifth bits as bit planes.
#if defined(SPECDEC_VNNI)
constexpr bool AVX2_LAYOUT = false;
#else
constexpr bool AVX2_LAYOUT = true;
#endif

// Bytes of one 32-block of a group of 16 rows (IQ4_NL, AVX2 builds only: Q4_0's layout, its codes for nibbles):
// d[16] fp16 | m[16] fp16 (Q4_1, Q5_1) | the fifth bits (Q5_0,
// Q5_1; VNNI: eight 64-bit masks, mask v bit 4r + i = row r's bit of weight 4v + i; AVX2: two 32-byte planes, one
// per eight rows, plane r / 8 byte 4 (r % 8) + i bit v = the same bit) | the weights: Q8_0 eight vectors (vector v,
// lane r: row r's weights 4v..4v+3; VNNI: plus 128), the others four vectors of packed nibbles (vector g, lane r:
// row r's qs[4g..4g+3], whose low nibbles are weights 4g.. and high nibbles weights 16 + 4g..). The same bytes per
// row as the GGML block.
template <int64_t type>
constexpr int64_t legacy_group_bytes() {
  return 32 + (has_min<type>() ? 32 : 0) + (five_bit<type>() ? 64 : 0) + (type == Q8_0 ? 512 : 256);
}

// The loop every layout shares: rows (N, row bytes) of blocks of in_bytes, N a multiple of 16 ->
// (N / 16, blocks * group_bytes), zeroed, then fill(o, p, r) writes row r's block p into its group's
// block o, for every group, block and row.
template <typename Fill>
torch::Tensor regroup(const torch::Tensor& rows, int64_t in_bytes, int64_t group_bytes, Fill&& fill) {
  const int64_t groups = rows.size(0) / GROUP, blocks = rows.size(1) / in_bytes;
  auto out = torch::zeros({groups, blocks * group_bytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t b = 0; b < blocks; ++b)
        for (int r = 0; r < GROUP; ++r)
          fill(dst + (gi * blocks + b) * group_bytes, src + (gi * GROUP + r) * rows.size(1) + b * in_bytes, r);
  });
  return out;
}

// rows (N, K / 32 * block bytes) of a 32-weight type, N a multiple of 16 -> (N / 16, K / 32 * group bytes).
template <int64_t type>
torch::Tensor repack_legacy(const torch::Tensor& rows) {
  constexpr int head = has_min<type>() ? 4 : 2;  // bytes of d (and m) at a block's start
  return regroup(rows, layout(type).bytes, legacy_group_bytes<type>(), [](uint8_t* o, const uint8_t* p, int r) {
    std::memcpy(o + 2 * r, p, 2);
    int64_t at = 32;
    if constexpr (has_min<type>()) {
      std::memcpy(o + at + 2 * r, p + 2, 2);
      at += 32;
    }
    const uint8_t* qs = p + head;
    if constexpr (five_bit<type>()) {
      const uint32_t qh = load_u32(p + head);
      for (int w = 0; w < 32; ++w) {  // weight w = 4v + i
        const uint8_t bit = (qh >> w) & 1;
        if constexpr (AVX2_LAYOUT)
          o[at + 32 * (r / 8) + 4 * (r % 8) + w % 4] |= static_cast<uint8_t>(bit << (w / 4));
        else
          o[at + 8 * (w / 4) + r / 2] |= static_cast<uint8_t>(bit << (4 * (r % 2) + w % 4));
      }
      at += 64;
      qs += 4;
    }
    if constexpr (type == Q8_0) {
      for (int w = 0; w < 32; ++w) o[at + 64 * (w / 4) + 4 * r + w % 4] = AVX2_LAYOUT ? qs[w] : qs[w] ^ 0x80;
    } else {
      for (int g = 0; g < 4; ++g) std::memcpy(o + at + 64 * g + 4 * r, qs + 4 * g, 4);
    }
  });
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// Software prefetch of the weights, for every tile, one input row included: the regrouped kernels fetch each
// cache line a fixed distance ahead of the line they read (a thread's groups lie one after another), as they
// go, so the prefetches spread over the work. (Bursts 1 KB ahead, all of a K-quant super-block's 40-50 lines at
// once, stalled on the line-fill buffers: docs/quantized.md.) Prefetching changes no output's bits.
constexpr int64_t AHEAD_BLOCKS = 16;  // 32-weight blocks of a group ahead (Q4_1: 5 KB)
constexpr int64_t AHEAD_SUPERS = 2;    // K-quant super-blocks of a group ahead (Q4_K: 4.6 KB, Q6_K: 6.6 KB)
inline void fetch_lines(const uint8_t* p, int64_t bytes, int64_t distance) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + distance + o, _MM_HINT_T0);
}

constexpr int offset_index(int32_t offset) { return offset == 8 ? 0 : offset == 16 ? 1 : 2; }

// ---- Q4_K ---------------------------------------------------------------------------------------
//
// A group's bytes per super-block: d[16] fp16 | dmin[16] fp16 | scales[8][16] (sub-block j, row) |
// minimums[4][16][2] (pair i, row, sub-block 2i + h: bytes that widen to 16-bit pairs per row) |
// nibbles[4][8][64] (chunk i, vector g, lane r: row r's qs[32i + 4g..+3], whose low nibbles are
// sub-block 2i's weights 4g.. and high nibbles sub-block 2i + 1's).
// AVX2 builds keep the nibbles of each half (rows 8h..8h+7) together, in the order their kernel reads them:
// [h][i][g], 32 bytes each (lane r % 8).
constexpr int64_t Q4_K_GROUP_BYTES = 64 + 128 + 128 + 2048;
constexpr int64_t Q4_K_NIBBLES = 320;
constexpr int64_t q4k_nibbles(int i, int g, int r) {  // the offset of row r's four bytes of chunk i's vector g
  return AVX2_LAYOUT ? Q4_K_NIBBLES + 1024 * (r / 8) + 256 * i + 32 * g + 4 * (r % 8) : Q4_K_NIBBLES + 512 * i + 64 * g + 4 * r;
}

torch::Tensor repack_q4k(const torch::Tensor& rows) {
  return regroup(rows, 144, Q4_K_GROUP_BYTES, [](uint8_t* o, const uint8_t* p, int r) {
    std::memcpy(o + 2 * r, p, 2);
    std::memcpy(o + 32 + 2 * r, p + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int a, e;
      scale_min_k4(p + 4, j, a, e);
      o[64 + 16 * j + r] = static_cast<uint8_t>(a);
      o[192 + 32 * (j / 2) + 2 * r + j % 2] = static_cast<uint8_t>(e);
    }
    for (int i = 0; i < 4; ++i)
      for (int g = 0; g < 8; ++g) std::memcpy(o + q4k_nibbles(i, g, r), p + 16 + 32 * i + 4 * g, 4);
  });
}

// ---- Q6_K ---------------------------------------------------------------------------------------
//
// A group's bytes per super-block: d[16] fp16 | scales[16][16] int8 (sub-block j, row) | nibbles[32][64]
// (vector v, lane r, byte i: low nibble = the low four bits of row r's weight 4v + i, high nibble =
// those of weight 128 + 4v + i) | highs[16][64] (vector v, lane r, byte i: bits 2k, 2k + 1 = the top two
// bits of weight 64k + 4v + i). The same bytes per row as the GGML block.
// The vectors lie in the order the kernels read them, one run per j < 4: nibble vectors 4j..4j+3, 16 + 4j..16 + 4j + 3
// and high vectors 4j..4j+3. AVX2 builds keep each half (rows 8h..8h+7) together: its runs of 32-byte vectors (lane
// r % 8), then the other half's.
constexpr int64_t Q6_K_GROUP_BYTES = 32 + 256 + 2048 + 1024;
constexpr int64_t Q6_K_NIBBLES = 288;
constexpr int Q6_K_LANES = AVX2_LAYOUT ? 8 : 16;                 // rows per vector
constexpr int64_t Q6_K_VECTOR = 4 * Q6_K_LANES;                  // its bytes
constexpr int64_t Q6_K_RUN = 12 * Q6_K_VECTOR;                  // one j's run
constexpr int64_t Q6_K_HALF = 4 * Q6_K_RUN;                     // the runs of one vector's rows (AVX2: a half)
constexpr int64_t q6k_vector(int run, int at, int r) {  // the offset of row r's four bytes of vector `at` of run `run`
  return Q6_K_NIBBLES + Q6_K_HALF * (r / Q6_K_LANES) + Q6_K_RUN * run + Q6_K_VECTOR * at + 4 * (r % Q6_K_LANES);
}
constexpr int64_t q6k_nibbles(int v, int r) { return q6k_vector(v % 16 / 4, 4 * (v / 16) + v % 4, r); }  // nibble vector v
constexpr int64_t q6k_highs(int v, int r) { return q6k_vector(v / 4, 8 + v % 4, r); }                    // high vector v

torch::Tensor repack_q6k(const torch::Tensor& rows) {
  return regroup(rows, 210, Q6_K_GROUP_BYTES, [](uint8_t* o, const uint8_t* p, int r) {
    uint8_t q[256];  // the row's 6-bit weights (0..63), as ggml's dequantize_row_q6_K reads them
    for (int half = 0; half < 2; ++half) {
      const uint8_t *ql = p + 64 * half, *qh = p + 128 + 32 * half;
      for (int l = 0; l < 32; ++l) {
        q[128 * half + l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
        q[128 * half + l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
        q[128 * half + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        q[128 * half + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    std::memcpy(o + 2 * r, p + 208, 2);
    for (int j = 0; j < 16; ++j) o[32 + 16 * j + r] = p[192 + j];
    for (int v = 0; v < 32; ++v)
      for (int i = 0; i < 4; ++i)
        o[q6k_nibbles(v, r) + i] = static_cast<uint8_t>((q[4 * v + i] & 15) | ((q[128 + 4 * v + i] & 15) << 4));
    for (int v = 0; v < 16; ++v)
      for (int i = 0; i < 4; ++i) {
        uint8_t h = 0;
        for (int k = 0; k < 4; ++k) h |= static_cast<uint8_t>((q[64 * k + 4 * v + i] >> 4) << (2 * k));
        o[q6k_highs(v, r) + i] = h;
      }
  });
}

// ---- IQ4_XS (AVX2 builds) -----------------------------------------------------------------------
//
// A group's bytes per super-block: d[16] fp16 | scales[8][16] int8 (sub-block j, row: its 6-bit scale minus 32) |
// codes[2][8][4][32] (half h: rows 8h..8h+7, sub-block j, vector g, lane r % 8: row r's qs[16j + 4g..+3], whose low
// nibbles are the codes of weights 32j + 4g.. and high nibbles those of 32j + 16 + 4g..), each half's bytes together
// in the order the kernel reads them. 138 bytes a row for the block's 136.
constexpr int64_t IQ4_XS_GROUP_BYTES = 32 + 128 + 2048;

[[maybe_unused]] torch::Tensor repack_iq4xs(const torch::Tensor& rows) {  // AVX2 builds only
  return regroup(rows, 136, IQ4_XS_GROUP_BYTES, [](uint8_t* o, const uint8_t* p, int r) {
    std::memcpy(o + 2 * r, p, 2);
    uint16_t high;
    std::memcpy(&high, p + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
      o[32 + 16 * j + r] = static_cast<uint8_t>(scale - 32);
      for (int g = 0; g < 4; ++g) std::memcpy(o + 160 + 1024 * (r / 8) + 128 * j + 32 * g + 4 * (r % 8), p + 8 + 16 * j + 4 * g, 4);
    }
  });
}

// The kernels of one group of sixteen weight rows times T quantized input rows (x's rows m0..m0+T-1): out[m][r].
// Declared here, defined once per instruction set (int8_x16.h, int8_x16_avx2.h).
template <int64_t type, int T>
void legacy_x16_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[GROUP]);
template <int T>
void q4k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]);
template <int T>
void q6k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]);
template <int T>
void iq4xs_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]);  // AVX2 builds only

// ---- a part's outputs ---------------------------------------------------------------------------

// y[:, j] for the groups of sixteen rows covering [lo, hi) (multiples of 16) of one regrouped part, input rows
// m_begin.. of x:
// tiles[t] computes a group's sixteen outputs for t input rows. A thread goes over a block of groups
// (about WEIGHT_BLOCK bytes) for each tile of input rows, so many input rows stream the weights
// from L2; the order changes no output's operations.
template <typename Rows>
void grouped_outputs(void (*const* tiles)(const uint8_t*, const Rows&, int64_t, float (*)[GROUP]),
                     const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const Rows& x, float* y,
                     int64_t N, int64_t m_begin) {
  float out[X16_TILE][GROUP];
  const int64_t block = std::max<int64_t>(GROUP, WEIGHT_BLOCK / group_bytes * GROUP);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = m_begin; m0 < x.M; m0 += X16_TILE) {
      const int t = static_cast<int>(std::min<int64_t>(X16_TILE, x.M - m0));
      for (int64_t j = j0; j < std::min(hi, j0 + block); j += GROUP) {
        tiles[t](groups + (j - lo) / GROUP * group_bytes, x, m0, out);
        for (int m = 0; m < t; ++m) std::memcpy(y + (m0 + m) * N + j, out[m], sizeof out[m]);
      }
    }
}

template <typename Rows, template <int> class Tile>
void tiled_outputs(const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const Rows& x, float* y,
                   int64_t N, int64_t m_begin = 0) {
  using Fn = void (*)(const uint8_t*, const Rows&, int64_t, float (*)[GROUP]);
  static constexpr Fn tiles[X16_TILE + 1] = {nullptr,       Tile<1>::run, Tile<2>::run, Tile<3>::run, Tile<4>::run,
                                             Tile<5>::run,  Tile<6>::run, Tile<7>::run, Tile<8>::run};
  grouped_outputs<Rows>(tiles, groups, group_bytes, lo, hi, x, y, N, m_begin);
}

template <int64_t type>
struct LegacyTile {
  template <int T>
  struct At {
    static void run(const uint8_t* g, const QRows& x, int64_t m0, float (*out)[GROUP]) {
      legacy_x16_tile<type, T>(g, x, m0, out);
    }
  };
};
template <int T>
struct Q6KTile {
  static void run(const uint8_t* g, const KRows& x, int64_t m0, float (*out)[GROUP]) { q6k_x16_tile<T>(g, x, m0, out); }
};
template <int T>
struct IQ4XSTile {
  static void run(const uint8_t* g, const KRows& x, int64_t m0, float (*out)[GROUP]) { iq4xs_x16_tile<T>(g, x, m0, out); }
};
template <int T>
struct Q4KTile {
  static void run(const uint8_t* g, const KRows& x, int64_t m0, float (*out)[GROUP]) { q4k_x16_tile<T>(g, x, m0, out); }
};

// The GGML type a regrouped type id stands for, or -1.
inline int64_t regrouped_base(int64_t type) {
  const int64_t base = type - X16;
  return base == Q4_0 || base == Q4_1 || base == Q5_0 || base == Q5_1 || base == Q8_0 || base == Q4_K || base == Q6_K ||
                 ((base == IQ4_NL || base == IQ4_XS) && AVX2_LAYOUT)  // VNNI: a row at a time (int8_halves.h)
             ? base
             : -1;
}

// Bytes per group of sixteen rows of a regrouped type with K columns; 0 for the other types.
int64_t regrouped_bytes(int64_t type, int64_t K) {
  switch (regrouped_base(type)) {
    case Q4_0: return K / 32 * legacy_group_bytes<Q4_0>();
    case Q4_1: return K / 32 * legacy_group_bytes<Q4_1>();
    case Q5_0: return K / 32 * legacy_group_bytes<Q5_0>();
    case Q5_1: return K / 32 * legacy_group_bytes<Q5_1>();
    case Q8_0: return K / 32 * legacy_group_bytes<Q8_0>();
    case IQ4_NL: return K / 32 * legacy_group_bytes<IQ4_NL>();
    case IQ4_XS: return K / 256 * IQ4_XS_GROUP_BYTES;
    case Q4_K: return K / 256 * Q4_K_GROUP_BYTES;
    case Q6_K: return K / 256 * Q6_K_GROUP_BYTES;
  }
  return 0;
}

// A matrix's rows regrouped sixteen at a time for the int8 kernels: (the regrouped tensor, its type id)
// for the regrouped types, rows (N, row bytes) with N a multiple of 16; None for the others, which go a row at a time
// (F32, Q2_K, ... with fp32 activations; the halves types on their int8 kernels).
c10::optional<std::tuple<torch::Tensor, int64_t>> repack(torch::Tensor rows, int64_t type, int64_t K) {
  if (!has_int8_kernel(type) || regrouped_base(X16 + type) < 0) return c10::nullopt;  // the halves types, ...
  const Layout lay = layout(type);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kUInt8 && rows.is_contiguous() && K % lay.block == 0 &&
                  rows.size(1) == K / lay.block * lay.bytes && rows.size(0) % GROUP == 0,
              "quant.repack: rows must be contiguous uint8 (N, ", K / lay.block * lay.bytes,
              "), N a multiple of sixteen");
  torch::Tensor out;
  switch (type) {
    case Q4_0: out = repack_legacy<Q4_0>(rows); break;
    case Q4_1: out = repack_legacy<Q4_1>(rows); break;
    case Q5_0: out = repack_legacy<Q5_0>(rows); break;
    case Q5_1: out = repack_legacy<Q5_1>(rows); break;
    case Q8_0: out = repack_legacy<Q8_0>(rows); break;
    case Q4_K: out = repack_q4k(rows); break;
    case Q6_K: out = repack_q6k(rows); break;
#if !defined(SPECDEC_VNNI)
    case IQ4_NL: out = repack_legacy<IQ4_NL>(rows); break;
    case IQ4_XS: out = repack_iq4xs(rows); break;
#endif
  }
  return std::make_tuple(out, X16 + type);
}

// y[:, lo..hi) of one regrouped part (groups: its (N / 16, group bytes) rows from group lo / 16).
void regrouped_outputs(int64_t type, const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi,
                       const QRows& qx, const KRows& kx, float* y, int64_t N) {
  switch (regrouped_base(type)) {
    case Q4_0: return tiled_outputs<QRows, LegacyTile<Q4_0>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case Q4_1: return tiled_outputs<QRows, LegacyTile<Q4_1>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case Q5_0: return tiled_outputs<QRows, LegacyTile<Q5_0>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case Q5_1: return tiled_outputs<QRows, LegacyTile<Q5_1>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case Q8_0: return tiled_outputs<QRows, LegacyTile<Q8_0>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case Q4_K: return tiled_outputs<KRows, Q4KTile>(groups, group_bytes, lo, hi, kx, y, N);
    case Q6_K: return tiled_outputs<KRows, Q6KTile>(groups, group_bytes, lo, hi, kx, y, N);
#if !defined(SPECDEC_VNNI)
    case IQ4_NL: return tiled_outputs<QRows, LegacyTile<IQ4_NL>::At>(groups, group_bytes, lo, hi, qx, y, N);
    case IQ4_XS: return tiled_outputs<KRows, IQ4XSTile>(groups, group_bytes, lo, hi, kx, y, N);
#endif
  }
  TORCH_CHECK(false, "quant: not a regrouped type: ", type);
}

}  // namespace
#endif

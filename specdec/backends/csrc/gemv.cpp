// y = x W^T (+ b) in fp32 for one or two rows x: the matrix-vector products of a decoding step.
//
// Why (specdec/backends/gemv.py has the figures): a one-token forward is a chain of matrix-vector products
// that should run at the speed memory delivers the weights. oneDNN's fp32 kernels reach about
// two thirds of that on a 2-core AMD EPYC; reading each weight row once, front to back, with two
// independent 16-lane accumulators per input row, reaches more. Rows of the weight are split
// across torch's intra-op threads (at::parallel_for), so no second thread pool is started.
//
// Each output y[m, j] is summed in the same order whatever the number of input rows, so one- and
// two-row products agree bit for bit. The weight may come in parts (the q, k, v projections, say):
// their outputs are laid side by side, as the product with the concatenated weight would give.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

typedef float vec __attribute__((vector_size(64)));  // 16 fp32 lanes: one AVX-512 register, two AVX2 ones

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline float lane_sum(vec a) {
  typedef float half __attribute__((vector_size(32)));
  typedef float quarter __attribute__((vector_size(16)));
  half h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// y[m * y_stride + j] = x[m, :] . w[j, :] (+ b[j]) for j in [j0, j1), m < M; x (M, K), w (rows, K).
template <int M>
void rows(const float* x, const float* w, const float* b, float* y, int64_t K, int64_t y_stride, int64_t j0, int64_t j1) {
  const int64_t chunks = K / 16;
  for (int64_t j = j0; j < j1; ++j) {
    const float* wj = w + j * K;
    vec even[M] = {}, odd[M] = {};
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      const vec w0 = load(wj + c * 16), w1 = load(wj + c * 16 + 16);
      for (int m = 0; m < M; ++m) {
        even[m] += w0 * load(x + m * K + c * 16);
        odd[m] += w1 * load(x + m * K + c * 16 + 16);
      }
    }
    if (c < chunks) {
      const vec w0 = load(wj + c * 16);
      for (int m = 0; m < M; ++m) even[m] += w0 * load(x + m * K + c * 16);
    }
    for (int m = 0; m < M; ++m) {
      float s = lane_sum(even[m] + odd[m]);
      for (int64_t i = chunks * 16; i < K; ++i) s += x[m * K + i] * wj[i];
      y[m * y_stride + j] = b ? s + b[j] : s;
    }
  }
}

}  // namespace

// x: (M, K) fp32, M in {1, 2}; parts: weights (N_p, K) fp32, contiguous; bias: (sum N_p,) or None.
// Returns (M, sum N_p).
torch::Tensor gemv(torch::Tensor x, std::vector<torch::Tensor> parts, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && (x.size(0) == 1 || x.size(0) == 2),
              "gemv: x must be (1 or 2, K) fp32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> offsets{0};
  for (const auto& w : parts) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == torch::kFloat && w.is_contiguous(),
                "gemv: each weight must be a contiguous (N, K) fp32 tensor");
    offsets.push_back(offsets.back() + w.size(0));
  }
  const int64_t N = offsets.back();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat && bias->is_contiguous(), "gemv: bad bias");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (size_t p = 0; p < parts.size(); ++p) {
      const int64_t lo = std::max(begin, offsets[p]), hi = std::min(end, offsets[p + 1]);
      if (lo >= hi) continue;
      const float* w = parts[p].data_ptr<float>();
      const float* bp = b ? b + offsets[p] : nullptr;
      float* yp_p = yp + offsets[p];  // this part's columns
      if (M == 1) rows<1>(xp, w, bp, yp_p, K, N, lo - offsets[p], hi - offsets[p]);
      else rows<2>(xp, w, bp, yp_p, K, N, lo - offsets[p], hi - offsets[p]);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv, "y = x W^T (+ b), fp32, 1 or 2 rows"); }

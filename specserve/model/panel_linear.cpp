// y = x W^T + b on the CPU, fp32, with W packed in panels of 16 output features.
//
// Layout: W [N, K] is packed once as P [ceil(N / 16), K, 16] with P[p][k][j] = W[16 p + j][k] (zero rows
// pad N up to a multiple of 16). One step over k reads 16 consecutive floats of a panel, so a decode
// step streams every weight exactly once, in order, which is what a memory-bound one-row product needs.
//
// Summation order (the reason this kernel exists): every output y[m][n] is accumulated over k = 0, 1,
// ..., K - 1 in that order, one fused multiply-add per step, starting from 0, and the bias is added
// last. Nothing about that order depends on how many rows x has, which rows sit beside row m, how the
// rows are tiled, or how the panels are split between threads. So a row's result is bit-identical
// alone and in any batch (batch invariance): a one-row decode and the same position inside a verify
// block of 1 + k rows give the same logits, and a seeded request draws the same tokens in any batch.
// Design notes and measurements: docs/cpu_performance.md, "Linear layers: the panel kernel".
//
// Tiling: a tile is MB rows of x (up to 6) against NV panels (4, i.e. 64 output features): up to 24
// accumulators of 16 floats, which the compiler keeps in vector registers (AVX-512: one zmm each).
// Threads split the panels (torch's intra-op pool, at::parallel_for), never the k range.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int kLanes = 16;  // output features per panel
constexpr int kPanelsPerTile = 4;
constexpr int kRowsPerTile = 6;  // 6 x 4 = 24 accumulators + 4 weight vectors + 1 broadcast: 29 of 32 zmm

template <int MB, int NV>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict panels, const float* __restrict bias,
                 float* __restrict y, int64_t ldy) {
  float acc[MB][NV][kLanes];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) acc[m][v][j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const float* w = panels + (v * K + k) * kLanes;
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const float xv = x[m * K + k];
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) acc[m][v][j] = std::fma(xv, w[j], acc[m][v][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < kLanes; ++j)
        y[m * ldy + v * kLanes + j] = bias ? acc[m][v][j] + bias[v * kLanes + j] : acc[m][v][j];
}

// every row of x against NV panels: tiles of kRowsPerTile rows, then the rest
template <int NV>
void panels_all_rows(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                     int64_t ldy) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile) tile<kRowsPerTile, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy);
  switch (M - m) {
    case 5: tile<5, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy); break;
    case 4: tile<4, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy); break;
    case 3: tile<3, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy); break;
    case 2: tile<2, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy); break;
    case 1: tile<1, NV>(x + m * K, K, panels, bias, y + m * ldy, ldy); break;
    default: break;
  }
}

}  // namespace

// W [N, K] float32 -> panels [ceil(N / 16), K, 16] float32 (zero rows pad N).
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack: weight must be a 2-D float32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), NP = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({NP * kLanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({NP, kLanes, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 contiguous, panels from pack(), bias [N] or None -> y [M, N] (N = out_features)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kLanes && panels.size(1) == x.size(1) && panels.is_contiguous(),
              "linear: panels must come from pack() for in_features = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = panels.size(0), N = out_features;
  TORCH_CHECK(N > (NP - 1) * kLanes && N <= NP * kLanes, "linear: out_features does not match the panels");
  const int64_t ldy = NP * kLanes;
  // padded output columns (N < ldy) need a padded bias too: the tile reads 16 bias values per panel
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32, "linear: bias must be [out_features] float32");
    b = bias->contiguous();
    if (ldy != N) b = torch::cat({b, torch::zeros({ldy - N}, b.options())});
  }
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return ldy == N ? y : y.narrow(1, 0, N).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = (NP + kPanelsPerTile - 1) / kPanelsPerTile;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * kPanelsPerTile, count = std::min<int64_t>(kPanelsPerTile, NP - p0);
      if (count == kPanelsPerTile) {
        panels_all_rows<kPanelsPerTile>(xp, M, K, pp + p0 * K * kLanes, bp ? bp + p0 * kLanes : nullptr,
                                        yp + p0 * kLanes, ldy);
      } else {
        for (int64_t p = p0; p < p0 + count; ++p)
          panels_all_rows<1>(xp, M, K, pp + p * K * kLanes, bp ? bp + p * kLanes : nullptr, yp + p * kLanes, ldy);
      }
    }
  });
  return ldy == N ? y : y.narrow(1, 0, N).contiguous();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] float32 -> panels [ceil(N/16), K, 16]");
  m.def("linear", &linear, "x [M, K] @ W^T (+ b) -> [M, N], each row summed in a fixed order");
}

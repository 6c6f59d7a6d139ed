// The work of a decoder layer between its linear layers, fused, for fp32 on the CPU: RMSNorm (with the
// residual add before it), RoPE + KV-cache write + causal attention over the cache, and SwiGLU's
// silu(gate) * up. The linear layers stay in panel_linear.cpp. Design notes and measurements:
// docs/cpu_performance.md, "Fused layer kernels".
//
// Why: in eager PyTorch these are ~25 small ops per layer (views, pow/mean/rsqrt, roll/mul/add,
// index_put, one SDPA call per sequence, silu, mul). At the 0.5b model's decode shapes each op is a
// few microseconds of work behind a few microseconds of Python and dispatch, and together they were
// 9.6 ms of a 72 ms one-row step and 12.9 ms of an 85 ms four-row step on the 2-core host.
//
// Row independence (the property the engine relies on, as for the panel kernel): every output row is
// computed from its own input row (and, for attention, from the cache up to its own position) with a
// fixed order of operations that does not depend on how many rows the call has, which rows sit beside
// it, or how rows are split between threads. So a verify block of 1 + k rows gives each row the bits a
// one-token decode at that position gives, and a seeded request draws the same tokens in any batch.
//  - Sums over a vector (RMSNorm's sum of squares, a query-key dot product) go into 16 lanes, lane l
//    taking elements l, l + 16, l + 32, ... in order with a fused multiply-add, then the lanes are
//    added in a fixed tree (8, 4, 2, 1).
//  - Softmax: the row's maximum, exp(s - max) by `exp_poly` (below), their sum in key order, then the
//    output is the exp-weighted sum of value rows in key order (fused multiply-add, vectorized over the
//    head dimension), divided by the sum.
//  - The file is compiled with -ffp-contract=off, so the compiler fuses no multiply-add the source does
//    not ask for: RoPE (x * cos + rotate_half(x) * sin) and RMSNorm's (x * r) * w round each product as
//    the eager ops do, so RoPE gives the eager path's bits exactly.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;

// sum over i < n of a[i] * b[i] (a == b for a sum of squares), n a multiple of 16, in the lane order
// described above: lane l takes i = l, l + 16, ... with a fused multiply-add, then lanes l and l + w are
// added for w = 8, 4, 2, 1. The AVX-512 (F + DQ) and AVX2 forms do exactly these operations in this order
// (so all three give the same bits; tests/unit/test_cpu_layer_ops.py builds the others with
// -DSPECSERVE_PORTABLE and -mno-avx512f and compares); only the portable loop is left to the compiler,
// which does not vectorize the lane tree well (13 ns for a 64-element product against ~2 ns).
inline float dot_lanes(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(SPECSERVE_PORTABLE)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#elif defined(__AVX2__) && defined(__FMA__) && !defined(SPECSERVE_PORTABLE)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
  }
  __m256 h8 = _mm256_add_ps(lo, hi);
  __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#else
  float acc[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
#endif
}

// e^x for x in [-87, 88] (clamped outside): Cody-Waite range reduction to r in [-ln2/2, ln2/2] and
// Cephes' degree-6 polynomial for expf (about 1 ulp). Branch-free, so a loop over an array vectorizes.
inline float exp_poly(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// y[i] = exp_poly(x[i] - shift) for i < n (y may be x); a NaN stays NaN (exp_poly's clamp would hide it)
inline void exp_shifted(const float* x, float shift, int64_t n, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - shift;
    y[i] = d != d ? d : exp_poly(d);
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.stride(1) == 1,
              name, " must be a 2-D float32 CPU tensor with contiguous rows");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float mean = dot_lanes(x, x, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

// grain: rows per task. Small calls (a decode step's few rows) stay on the calling thread: the pool's
// wake-up costs more than the work.
constexpr int64_t kRowGrain = 8;

// sum of x[0..n) in the lane order: lane l takes x[l], x[l + 16], ... in turn, then the lane tree of
// dot_lanes (all x >= 0 here, so lanes without an element can be treated as + 0 without changing bits)
inline float sum_lanes(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] += x[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Causal attention of G query rows (heads sharing one kv head) over keys/values [0, n) of one slot.
// q: [G, D]; keys, vals: [>= n, D]; out: [G, D]. DC: D as a compile-time constant (0: use D), so that for
// the common head sizes a head's D accumulators stay in registers across the keys.
template <int DC>
void attend_group(const float* __restrict q, const float* __restrict keys, const float* __restrict vals, int64_t n,
                  int64_t G, int64_t Drt, float scale, std::vector<float>& scores, float* __restrict out) {
  const int64_t D = DC ? DC : Drt;
  scores.resize(G * n);
  float* sp = scores.data();
  for (int64_t j = 0; j < n; ++j)  // key j's row is read once for the G heads
    for (int64_t h = 0; h < G; ++h) sp[h * n + j] = dot_lanes(q + h * D, keys + j * D, D) * scale;
  for (int64_t h = 0; h < G; ++h) {
    float* s = sp + h * n;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);  // exact in any order
    exp_shifted(s, m, n, s);
    const float sum = sum_lanes(s, n);
    float acc[DC ? DC : 1024];  // D <= 1024 is checked by the caller
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float p = s[j];
      const float* v = vals + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p, v[d], acc[d]);
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[d] / sum;
  }
}

}  // namespace

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; x [T, N] -> y [T, N]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm: x");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(w.numel() == N && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu(),
              "rms_norm: w must be [N] float32 on the CPU");
  TORCH_CHECK(N % kLanes == 0, "rms_norm: N must be a multiple of 16");
  auto y = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * ld, wp, static_cast<float>(eps), N, yp + t * N);
  });
  return y;
}

// x[t] += residual[t] (in place: x becomes the next residual), then returns rms_norm(x); x, residual [T, N]
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& w, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == N, "add_rms_norm: residual must have x's shape");
  TORCH_CHECK(w.numel() == N && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu(),
              "add_rms_norm: w must be [N] float32 on the CPU");
  TORCH_CHECK(N % kLanes == 0, "add_rms_norm: N must be a multiple of 16");
  auto y = torch::empty({T, N}, x.options());
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldr = residual.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = xp + t * ldx;
      const float* res = rp + t * ldr;
      for (int64_t i = 0; i < N; ++i) row[i] = row[i] + res[i];
      norm_row(row, wp, static_cast<float>(eps), N, yp + t * N);
    }
  });
  return y;
}

// silu(gate) * up for gate_up [T, 2I] (gate = first I columns, up = last I) -> [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_mul: gate_up must have an even number of columns");
  auto y = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  // split columns as well as rows: a decode step has one row of 4864 columns per request
  constexpr int64_t kChunk = 1024;
  const int64_t chunks = (I + kChunk - 1) / kChunk;
  at::parallel_for(0, T * chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t t = c / chunks, i0 = (c % chunks) * kChunk, i1 = std::min(I, i0 + kChunk);
      const float* g = gp + t * ld;
      const float* u = g + I;
      float* out = yp + t * I;
#pragma omp simd
      for (int64_t i = i0; i < i1; ++i) out[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
  });
  return y;
}

// RoPE on q and k, k and v written into the cache at (slot, position), then every token attends to the
// positions <= its own in its slot. qkv [T, (H + 2 Hkv) D] (q heads, then k heads, then v heads);
// cos, sin_signed [P, D] (rotate_half folded into the sign of sin's first half); positions, slots [T]
// int64; k_cache, v_cache [S, Hkv, L, D] (contiguous, written in place). Returns [T, H D].
torch::Tensor rope_cache_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                   const torch::Tensor& positions, const torch::Tensor& slots, torch::Tensor& k_cache,
                                   torch::Tensor& v_cache, int64_t H, int64_t Hkv, double scale) {
  check_rows(qkv, "rope_cache_attention: qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes()
                  && k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "rope_cache_attention: caches must be contiguous float32 [S, Hkv, L, D] of one shape");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && cos.device().is_cpu() && sin_signed.device().is_cpu()
                  && positions.device().is_cpu() && slots.device().is_cpu(),
              "rope_cache_attention: every tensor must be on the CPU");
  TORCH_CHECK(Hkv > 0 && H > 0, "rope_cache_attention: H and Hkv must be positive");
  const int64_t T = qkv.size(0), S = k_cache.size(0), L = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(1) == Hkv && H % Hkv == 0 && qkv.size(1) == (H + 2 * Hkv) * D && D % kLanes == 0 && D <= 1024,
              "rope_cache_attention: qkv columns must be (H + 2 Hkv) * D, H a multiple of Hkv, D a multiple of 16 <= 1024");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.dim() == 2 && cos.size(1) == D
                  && cos.sizes() == sin_signed.sizes() && cos.scalar_type() == torch::kFloat32
                  && sin_signed.scalar_type() == torch::kFloat32,
              "rope_cache_attention: cos and sin_signed must be contiguous float32 [P, D]");
  TORCH_CHECK(positions.numel() == T && slots.numel() == T && positions.scalar_type() == torch::kInt64
                  && slots.scalar_type() == torch::kInt64 && positions.is_contiguous() && slots.is_contiguous(),
              "rope_cache_attention: positions and slots must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < L && pos[t] < cos.size(0) && slot[t] >= 0 && slot[t] < S,
                "rope_cache_attention: token ", t, " has position ", pos[t], " / slot ", slot[t], " outside the cache");
  const int64_t G = H / Hkv, half = D / 2, ld = qkv.stride(0);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  auto q = torch::empty({T, H, D}, qkv.options());
  float* qp = q.data_ptr<float>();

  // x * cos + rotate_half(x) * sin, rotate_half(x)[d] = x[d + half] (d < half) or x[d - half], its sign
  // folded into sin_signed: the eager ops' products and sum, each rounded (-ffp-contract=off)
  auto rope = [&](const float* x, const float* c, const float* s, float* out) {
    for (int64_t d = 0; d < D; ++d) {
      const float a = x[d] * c[d];
      const float b = x[d < half ? d + half : d - half] * s[d];
      out[d] = a + b;
    }
  };
  // phase 1: rotate q (into q) and k (into the cache), copy v into the cache; per token. Two tokens of one
  // call never share a (slot, position) (the engine schedules each position once per step); if they did,
  // they would race on that cache row.
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = src + t * ld;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) rope(row + h * D, c, s, qp + (t * H + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = ((slot[t] * Hkv + h) * L + pos[t]) * D;
        rope(row + (H + h) * D, c, s, kc + at);
        std::memcpy(vc + at, row + (H + Hkv + h) * D, D * sizeof(float));
      }
    }
  });

  // phase 2: attention, one task per (token, kv head) and its G query heads (`attend_group`)
  auto out = torch::empty({T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Tasks in zigzag order of tokens (first, last, second, second to last, ...): at::parallel_for hands each
  // thread a contiguous range, and a prompt chunk's causal work grows with the position, so in token order
  // the thread with the chunk's end would get ~3/4 of it (two threads). Results do not depend on the order.
  at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t z = i / Hkv, kvh = i % Hkv;
      const int64_t t = z % 2 == 0 ? z / 2 : T - 1 - z / 2;
      const int64_t base = (slot[t] * Hkv + kvh) * L * D;
      const float* q0 = qp + (t * H + kvh * G) * D;  // the group's G query rows, one after another
      float* o = op + (t * H + kvh * G) * D;
      if (D == 64) attend_group<64>(q0, kc + base, vc + base, pos[t] + 1, G, D, sc, scores, o);
      else if (D == 128) attend_group<128>(q0, kc + base, vc + base, pos[t] + 1, G, D, sc, scores, o);
      else attend_group<0>(q0, kc + base, vc + base, pos[t] + 1, G, D, sc, scores, o);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x [T, N] -> RMSNorm(x) * w, each row summed in a fixed order");
  m.def("add_rms_norm", &add_rms_norm, "x += residual (in place), then rms_norm(x)");
  m.def("silu_mul", &silu_mul, "gate_up [T, 2I] -> silu(gate) * up [T, I]");
  m.def("rope_cache_attention", &rope_cache_attention,
        "RoPE, KV-cache write and causal attention over the cache for a ragged step -> [T, H D]");
}

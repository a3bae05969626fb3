// x @ W.T on the CPU for a weight stored as GGUF Q8_0 blocks: int8 codes with one float scale
// per 32 consecutive inputs, w = scale * code. A Q8_0 weight read this way is a quarter of its
// float32 bytes, and a decode step is bound by reading weights.
//
// Each weight is scale * code, computed in float (exact: an int8 code times a float16-born
// scale fits float32's mantissa), then multiplied with x and added into a fixed lane of a fixed
// accumulator. So out[m, n] is computed the same way whatever M is: a request's logits do not
// depend on what it is batched with.

#include "kernels.h"
#include "lanes.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;
// Weight rows dotted at once: each has its own accumulator, so the FMA units work on four
// independent chains, and each group of x loaded serves all four rows.
constexpr int64_t kRowsAtOnce = 4;

// The 8 int8 codes at p as floats times scale (exact).
inline __m256 weights8(const int8_t* p, __m256 scale) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), scale);
}

// out[r] = w[4t + r] . x for the kRowsAtOnce weight rows of task t. Lane j of a row's
// accumulator sums the products at k = j (mod 8), then the lanes are added in order: AVX2 on
// AVX2 and AVX-512 machines alike, so every machine computes the same arithmetic.
inline void dot_rows(const int8_t* codes, const float* scales, int64_t groups, const float* x,
                     float* out) {
  __m256 acc[kRowsAtOnce];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8),
                 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
    for (int64_t r = 0; r < kRowsAtOnce; ++r, codes += kGroup) {
      const __m256 scale = _mm256_set1_ps(scales[g * kRowsAtOnce + r]);
      acc[r] = _mm256_fmadd_ps(weights8(codes, scale), x0, acc[r]);
      acc[r] = _mm256_fmadd_ps(weights8(codes + 8, scale), x1, acc[r]);
      acc[r] = _mm256_fmadd_ps(weights8(codes + 16, scale), x2, acc[r]);
      acc[r] = _mm256_fmadd_ps(weights8(codes + 24, scale), x3, acc[r]);
    }
  }
  for (int64_t r = 0; r < kRowsAtOnce; ++r) out[r] = sum_lanes(acc[r]);
}

}  // namespace

// x: [M, K] float32. The weight [N, K] in tasks of 4 rows, each task's groups of 32 side by side
// so that a task reads one run of memory front to back: codes [N / 4, K / 32, 4, 32] int8,
// scales [N / 4, K / 32, 4] float32 (engine/quantization.py, Q8Weight). Returns [M, N] float32.
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 4 && scales.dim() == 3,
              "x [M, K], codes [N / 4, K / 32, 4, 32], scales [N / 4, K / 32, 4]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat,
              "x float32, codes int8, scales float32");
  const int64_t rows = x.size(0), k = x.size(1), tasks = codes.size(0), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == groups && codes.size(2) == kRowsAtOnce &&
                  codes.size(3) == kGroup && scales.size(0) == tasks &&
                  scales.size(1) == groups && scales.size(2) == kRowsAtOnce,
              "codes and scales do not match x's K (a multiple of 32)");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "contiguous codes and scales");
  const int64_t n_out = tasks * kRowsAtOnce;
  const auto xc = x.contiguous();
  auto out = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return out;
  const float* xs = xc.data_ptr<float>();
  const int8_t* q = codes.data_ptr<int8_t>();
  const float* d = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // A grain of 256 tasks keeps the per-task overhead small.
  at::parallel_for(0, tasks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; ++m)
        dot_rows(q + t * kRowsAtOnce * k, d + t * kRowsAtOnce * groups, groups, xs + m * k,
                 o + m * n_out + t * kRowsAtOnce);
  });
  return out;
}

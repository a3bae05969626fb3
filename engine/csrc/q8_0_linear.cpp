// x @ W.T on the CPU for a weight stored as GGUF Q8_0 blocks: int8 codes w in -127..127 with
// one float scale per 32 consecutive inputs. A Q8_0 weight read this way is a quarter of its
// float32 bytes, and a decode step is bound by reading weights.
//
// x is rounded per group to int16 (rounded_x.h, x ~= d * qx); per group,
// w . x = scale * d * (w . qx), the integer dot product exact. The arithmetic never depends on
// M or the machine: a request's logits do not depend on what it is batched with, on AVX2 and
// AVX-512 hosts alike.

#include "kernels.h"
#include "rounded_x.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

namespace {

// Weight rows dotted at once: each has its own accumulator, so the FMA units work on four
// independent chains, and each group of x loaded serves all four rows.
constexpr int64_t kRowsAtOnce = 4;

// The 16 int8 codes at p widened to int16.
inline __m256i codes16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// out[r] = w[4t + r] . x for the kRowsAtOnce weight rows of task t.
inline void dot_rows(const int8_t* codes, const float* scales, int64_t groups, const int16_t* qx,
                     const float* d, float* out) {
  __m256 acc[kRowsAtOnce];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kGroup));
    const __m256i x_hi =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kGroup + 16));
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int64_t r = 0; r < kRowsAtOnce; ++r, codes += kGroup) {
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(codes16(codes), x_lo),
                                           _mm256_madd_epi16(codes16(codes + 16), x_hi));
      // scale * d[g] as a vector product: the same float, without a broadcast from a register.
      const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(scales + g * kRowsAtOnce + r), dg);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
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
  const RoundedX rounded(xc.data_ptr<float>(), rows, k);
  const int8_t* q = codes.data_ptr<int8_t>();
  const float* d = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // A grain of 256 tasks keeps the per-task overhead small.
  at::parallel_for(0, tasks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; ++m)
        dot_rows(q + t * kRowsAtOnce * k, d + t * kRowsAtOnce * groups, groups, rounded.qx(m),
                 rounded.d(m), o + m * n_out + t * kRowsAtOnce);
  });
  return out;
}

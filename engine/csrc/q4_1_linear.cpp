// x @ W.T on the CPU for a weight stored as GGUF Q4_1-style groups: 4-bit codes q in 0..15
// with one float scale and one float min per 32 consecutive inputs, w = scale * q + min. A
// decode step is bound by reading weights; these are 0.75 bytes a weight against float32's 4.
//
// x is rounded per group to int16 (rounded_x.h, x ~= d * qx); per group,
// w . x = scale * d * (q . qx) + min * sum(x), sum(x) of the unrounded x. The arithmetic never
// depends on M or the machine: out[m, n] is computed the same way whatever the batch, on AVX2
// and AVX-512 hosts alike (integer sums are exact; the float steps run in one fixed order).

#include "kernels.h"
#include "rounded_x.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

namespace {

constexpr int64_t kGroupBytes = kGroup / 2;
// Weight rows dotted at once: four independent accumulator chains, each x group loaded once.
constexpr int64_t kRowsAtOnce = 4;
// How far ahead of the group being read the codes are prefetched: 16 groups of a task (a group
// of its rows is one 64-byte line). The hardware prefetcher alone left ~5% of the time at one
// row of x waiting on memory.
constexpr int64_t kPrefetchBytes = 1024;

// out[r] = w[r] . x for one task's kRowsAtOnce rows. A group's 16 bytes hold codes 0..15 in
// their low nibbles and 16..31 in their high ones: widened to int16 once, each byte's low nibble
// (a mask) lines up with 16 of qx's 32 and its high one (a shift, the byte being < 256) with
// the other 16. Few instructions a group: at one row of x the kernel runs at the rate the core
// issues them, short of the memory's.
inline void dot_rows(const uint8_t* codes, const float* scales, const float* mins,
                     int64_t groups, const int16_t* qx, const float* d, const float* sum,
                     float* out) {
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  __m256 acc[kRowsAtOnce];
  for (auto& a : acc) a = _mm256_setzero_ps();
  // The rows' min * sum(x) terms side by side: lane r is row r's, the same fused multiply-add
  // a group as one row on its own.
  __m128 min_terms = _mm_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, scales += kRowsAtOnce, mins += kRowsAtOnce) {
    const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kGroup));
    const __m256i x_hi =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kGroup + 16));
    const __m256 dg = _mm256_broadcast_ss(d + g);
    _mm_prefetch(reinterpret_cast<const char*>(codes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales) + kPrefetchBytes / 4, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mins) + kPrefetchBytes / 4, _MM_HINT_T0);
    min_terms = _mm_fmadd_ps(_mm_loadu_ps(mins), _mm_broadcast_ss(sum + g), min_terms);
    for (int64_t r = 0; r < kRowsAtOnce; ++r, codes += kGroupBytes) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      const __m256i dot =
          _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(bytes, low_nibble), x_lo),
                           _mm256_madd_epi16(_mm256_srli_epi16(bytes, 4), x_hi));
      const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(scales + r), dg);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  alignas(16) float min_lanes[kRowsAtOnce];
  _mm_store_ps(min_lanes, min_terms);
  for (int64_t r = 0; r < kRowsAtOnce; ++r) out[r] = sum_lanes(acc[r]) + min_lanes[r];
}

}  // namespace

// x: [M, K] float32. The weight [N, K] in tasks of 4 rows, each task's groups side by side so
// that a task reads one run of memory: codes [N / 4, K / 32, 4, 16] uint8, scales and mins
// [N / 4, K / 32, 4] float32 (engine/quantization.py, Int4Weight). Returns [M, N] float32.
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 4 && scales.dim() == 3 && mins.dim() == 3,
              "x [M, K], codes [N / 4, K / 32, 4, 16], scales and mins [N / 4, K / 32, 4]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu() &&
                  mins.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat,
              "x float32, codes uint8, scales and mins float32");
  const int64_t rows = x.size(0), k = x.size(1), tasks = codes.size(0), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == groups && codes.size(2) == kRowsAtOnce &&
                  codes.size(3) == kGroupBytes && scales.sizes() == mins.sizes() &&
                  scales.size(0) == tasks && scales.size(1) == groups &&
                  scales.size(2) == kRowsAtOnce,
              "codes, scales and mins do not match x's K (a multiple of 32)");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(),
              "contiguous codes, scales and mins");
  const int64_t n_out = tasks * kRowsAtOnce;
  const auto xc = x.contiguous();
  auto out = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return out;
  const float* xs = xc.data_ptr<float>();
  const RoundedX rounded(xs, rows, k);
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float* d = scales.data_ptr<float>();
  const float* lo = mins.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t task_values = kRowsAtOnce * groups;
  // A grain of 64 tasks: the layers' smallest weight (576 rows) still splits over two threads.
  at::parallel_for(0, tasks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; ++m)
        dot_rows(q + t * task_values * kGroupBytes, d + t * task_values, lo + t * task_values,
                 groups, rounded.qx(m), rounded.d(m), rounded.sum(m),
                 o + m * n_out + t * kRowsAtOnce);
  });
  return out;
}

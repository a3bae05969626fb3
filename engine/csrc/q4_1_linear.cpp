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

#include <algorithm>

namespace {

constexpr int64_t kGroupBytes = kGroup / 2;
// Weight rows dotted at once: four independent accumulator chains, each x group loaded once.
constexpr int64_t kRowsAtOnce = 4;
// How far ahead of the group being read the codes are prefetched: 16 groups of a task (a group
// of its rows is one 64-byte line). The hardware prefetcher alone left ~5% of the time at one
// row of x waiting on memory.
constexpr int64_t kPrefetchBytes = 1024;

// Rows of x dotted with a task at once: each group's codes are loaded and widened once for all
// of them, which at four rows of x had been most of the kernel's instructions.
constexpr int64_t kXRowsAtOnce = 4;

// The rounded rows of x a task is dotted with, and where their results go.
struct XRows {
  const int16_t* qx[kXRowsAtOnce];
  const float* d[kXRowsAtOnce];
  const float* sum[kXRowsAtOnce];
  float* out[kXRowsAtOnce];
};

// out[i][r] = w[r] . x[i] for one task's kRowsAtOnce rows and XR rows of x. A group's 16 bytes
// hold codes 0..15 in their low nibbles and 16..31 in their high ones: widened to int16 once,
// each byte's low nibble (a mask) lines up with 16 of qx's 32 and its high one (a shift, the
// byte being < 256) with the other 16. Each (x row, weight row) pair has its own accumulator
// and takes the same steps in the same order whatever XR is: a row's result does not depend on
// the rows it is batched with.
//
// With AVX-512 two weight rows share each instruction, one in each 256-bit half: every lane
// holds the same integers and takes the same float steps as the AVX2 code's, so both give the
// same bits.
template <int64_t XR>
inline void dot_rows(const uint8_t* codes, const float* scales, const float* mins,
                     int64_t groups, const XRows& x) {
#ifdef __AVX512BW__
  constexpr int64_t kPairs = kRowsAtOnce / 2;
  static_assert(kPairs == 2, "pair_scale_index and row_acc below name two pairs");
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  // Lanes 0..7 take a pair's first row's scale, lanes 8..15 its second's.
  const __m512i pair_scale_index[kPairs] = {
      _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
  __m512 acc[XR][kPairs];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
#else
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  __m256 acc[XR][kRowsAtOnce];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
#endif
  // The rows' min * sum(x) terms side by side: lane r is weight row r's.
  __m128 min_terms[XR];
  for (auto& m : min_terms) m = _mm_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, scales += kRowsAtOnce, mins += kRowsAtOnce) {
    _mm_prefetch(reinterpret_cast<const char*>(codes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales) + kPrefetchBytes / 4, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mins) + kPrefetchBytes / 4, _MM_HINT_T0);
    const __m128 group_mins = _mm_loadu_ps(mins);
    for (int64_t i = 0; i < XR; ++i)
      min_terms[i] = _mm_fmadd_ps(group_mins, _mm_broadcast_ss(x.sum[i] + g), min_terms[i]);
#ifdef __AVX512BW__
    __m512i x_lo[XR], x_hi[XR];
    __m512 dg[XR];
    for (int64_t i = 0; i < XR; ++i) {
      const int16_t* qx = x.qx[i] + g * kGroup;
      x_lo[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)));
      x_hi[i] =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 16)));
      dg[i] = _mm512_set1_ps(x.d[i][g]);
    }
    const __m512 group_scales = _mm512_castps128_ps512(_mm_loadu_ps(scales));
    for (int64_t p = 0; p < kPairs; ++p, codes += 2 * kGroupBytes) {
      const __m512i bytes =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
      const __m512i low = _mm512_and_si512(bytes, low_nibble);
      const __m512i high = _mm512_srli_epi16(bytes, 4);
      const __m512 pair_scale = _mm512_permutexvar_ps(pair_scale_index[p], group_scales);
      for (int64_t i = 0; i < XR; ++i) {
        const __m512i dot = _mm512_add_epi32(_mm512_madd_epi16(low, x_lo[i]),
                                             _mm512_madd_epi16(high, x_hi[i]));
        const __m512 scale = _mm512_mul_ps(pair_scale, dg[i]);
        acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i][p]);
      }
    }
#else
    __m256i x_lo[XR], x_hi[XR];
    __m256 dg[XR];
    for (int64_t i = 0; i < XR; ++i) {
      x_lo[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qx[i] + g * kGroup));
      x_hi[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qx[i] + g * kGroup + 16));
      dg[i] = _mm256_broadcast_ss(x.d[i] + g);
    }
    for (int64_t r = 0; r < kRowsAtOnce; ++r, codes += kGroupBytes) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      const __m256i low = _mm256_and_si256(bytes, low_nibble);
      const __m256i high = _mm256_srli_epi16(bytes, 4);
      const __m256 row_scale = _mm256_broadcast_ss(scales + r);
      for (int64_t i = 0; i < XR; ++i) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x_lo[i]),
                                             _mm256_madd_epi16(high, x_hi[i]));
        const __m256 scale = _mm256_mul_ps(row_scale, dg[i]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][r]);
      }
    }
#endif
  }
  for (int64_t i = 0; i < XR; ++i) {
    alignas(16) float min_lanes[kRowsAtOnce];
    _mm_store_ps(min_lanes, min_terms[i]);
#ifdef __AVX512BW__
    // A pair's first row in the low half of its accumulator, its second in the high half.
    const __m256 row_acc[kRowsAtOnce] = {
        _mm512_castps512_ps256(acc[i][0]), _mm512_extractf32x8_ps(acc[i][0], 1),
        _mm512_castps512_ps256(acc[i][1]), _mm512_extractf32x8_ps(acc[i][1], 1)};
#else
    const __m256* row_acc = acc[i];
#endif
    for (int64_t r = 0; r < kRowsAtOnce; ++r) x.out[i][r] = sum_lanes(row_acc[r]) + min_lanes[r];
  }
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
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* task_codes = q + t * task_values * kGroupBytes;
      const float* task_scales = d + t * task_values;
      const float* task_mins = lo + t * task_values;
      for (int64_t m = 0; m < rows; m += kXRowsAtOnce) {
        XRows x{};
        const int64_t num_x = std::min(kXRowsAtOnce, rows - m);
        for (int64_t i = 0; i < num_x; ++i) {
          x.qx[i] = rounded.qx(m + i);
          x.d[i] = rounded.d(m + i);
          x.sum[i] = rounded.sum(m + i);
          x.out[i] = o + (m + i) * n_out + t * kRowsAtOnce;
        }
        switch (num_x) {
          case 4: dot_rows<4>(task_codes, task_scales, task_mins, groups, x); break;
          case 3: dot_rows<3>(task_codes, task_scales, task_mins, groups, x); break;
          case 2: dot_rows<2>(task_codes, task_scales, task_mins, groups, x); break;
          default: dot_rows<1>(task_codes, task_scales, task_mins, groups, x);
        }
      }
    }
  });
  return out;
}

// The activations of a codes kernel (q4_1_linear.cpp, q8_0_linear.cpp) rounded per group of 32
// to int16 with a float scale, x ~= d * qx with |qx| <= kLevels: a group's dot product with the
// weight's codes is then integer multiply-adds (vpmaddwd), exact, instead of 32 int -> float
// conversions and FMAs, which bound the float kernels on an AVX2 core (docs/engine.md). Not int8
// as llama.cpp rounds them: on the bundled model int8 activations flipped 26 of 384 greedy
// tokens (bench/quant_quality.py); int16's (half a level, 1 / 65534 of the group's max |x|)
// flipped none. AVX2 on every machine.
#pragma once

#include "lanes.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

constexpr int64_t kGroup = 32;
// Largest |qx|. A group's integer dot product stays exact through its float conversion: at most
// 4 products of an int8 code and a value of 15 bits a lane, under 2^24.
constexpr float kLevels = 32767.f;

// x [rows, k] rounded: qx [rows * k] int16, and per group its scale d and the sum of the
// unrounded x (what a weight's per-group offset multiplies).
class RoundedX {
 public:
  RoundedX(const float* x, int64_t rows, int64_t k)
      : groups_(k / kGroup), qx_(rows * k), d_(rows * groups_), sum_(rows * groups_) {
    for (int64_t i = 0; i < rows * groups_; ++i)  // a decode step's few rows: microseconds
      round_group(x + i * kGroup, qx_.data() + i * kGroup, &d_[i], &sum_[i]);
  }

  const int16_t* qx(int64_t row) const { return qx_.data() + row * groups_ * kGroup; }
  const float* d(int64_t row) const { return d_.data() + row * groups_; }
  const float* sum(int64_t row) const { return sum_.data() + row * groups_; }

 private:
  // d = max|x| / kLevels (0 for a zero group); qx rounded to nearest, ties to even.
  static void round_group(const float* x, int16_t* qx, float* d, float* sum) {
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8),
                 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 amax8 = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
        _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax8);
    float amax = 0.f;
    for (float lane : lanes) amax = std::max(amax, lane);
    *d = amax / kLevels;
    *sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kLevels / amax : 0.f);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)),
                  i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)),
                  i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
    // packs works per 128-bit lane: it leaves the quarters (4 values each) in the order
    // 0 2 1 3 of the wanted ones, and one permute puts them back in order.
    const auto in_order = [](__m256i a, __m256i b) {
      return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx), in_order(i0, i1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + 16), in_order(i2, i3));
  }

  int64_t groups_;
  std::vector<int16_t> qx_;
  std::vector<float> d_, sum_;
};

// Horizontal sums of a vector's lanes, added in lane order: the kernels' fixed final step.
#pragma once

#include <immintrin.h>

inline float sum_lanes(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float s = 0.f;
  for (float lane : lanes) s += lane;
  return s;
}

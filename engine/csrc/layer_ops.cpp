// The decoder layer's element-wise steps on the CPU in float32, each one call instead of the
// dozen small torch ops it replaces (engine/model.py, FusedCPUOps).
//
// At one decode token a layer's matmuls read ~3 MB of int4 codes in ~0.23 ms on one core, while
// the norms, RoPE, the KV store and SiLU, run as torch ops, took ~0.3 ms more: ~60 dispatches of
// a few microseconds each, on rows of a few hundred floats. Here each step is one pass over its
// rows; a prompt chunk's rows are split over the threads.
//
// The arithmetic is Hugging Face Llama's (rms_norm: x / sqrt(mean(x^2) + eps) * weight; RoPE in
// the rotate-half layout; SiLU(gate) * up) in float32, summed in another order than torch's:
// results agree with the torch path to float rounding, not bit for bit.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

// Error messages are one std::string, never TORCH_CHECK's stream formatting of several values:
// streaming an integer inside an extension crashed (SIGSEGV in ostream's _M_insert<long>) with
// torch 2.11+cu130 and g++ 13.3, where a single string raised normally.

// Rows per task: a decode step's few rows stay on the calling thread.
constexpr int64_t kRowsPerTask = 16;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              std::string(name) +
                  " must be a float32 CPU tensor [rows, width] with contiguous rows");
}

void check_vector(const at::Tensor& w, int64_t width, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 &&
                  w.size(0) == width && w.is_contiguous(),
              std::string(name) + " must be a contiguous float32 CPU vector of " +
                  std::to_string(width));
}

inline void norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// out = x rotated by its position's angles (rotate-half: the first half pairs with the second).
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float lo = x[i], hi = x[i + half];
    out[i] = lo * cos[i] - hi * sin[i];
    out[i + half] = hi * cos[i + half] + lo * sin[i + half];
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_any, const at::Tensor& weight, double eps) {
  const auto x = x_any.contiguous();
  check_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  check_vector(weight, width, "weight");
  auto out = at::empty({rows, width}, x.options());
  const float *src = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(src + r * stride, w, dst + r * width, width, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta_any, const at::Tensor& weight,
                         double eps) {
  const auto delta = delta_any.contiguous();
  check_rows(x, "x");
  check_rows(delta, "delta");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(delta.size(0) == rows && delta.size(1) == width, "delta must be shaped like x");
  check_vector(weight, width, "weight");
  auto out = at::empty({rows, width}, x.options());
  float* residual = x.data_ptr<float>();
  const float *add = delta.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t stride = x.stride(0), delta_stride = delta.stride(0);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = residual + r * stride;
      const float* d = add + r * delta_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) row[i] += d[i];
      norm_row(row, w, dst + r * width, width, static_cast<float>(eps));
    }
  });
  return out;
}

void rope_store_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& cache, const at::Tensor& block_ids, const at::Tensor& offsets,
                    int64_t num_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cache.dim() == 5 && cache.scalar_type() == at::kFloat && cache.device().is_cpu() &&
                  cache.size(1) == 2,
              "cache must be one layer's float32 view [blocks, 2, block_size, Hkv, D]");
  const int64_t rows = qkv.size(0), block = cache.size(2), kv_heads = cache.size(3);
  const int64_t dim = cache.size(4);
  TORCH_CHECK(cache.stride(4) == 1 && cache.stride(3) == dim && cache.stride(2) == kv_heads * dim,
              "each block row of the cache must be contiguous");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * dim, "qkv width is (H + 2 Hkv) * D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == rows * dim &&
                  sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin: float32, contiguous, head_dim values a row");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  block_ids.numel() == rows && offsets.numel() == rows &&
                  block_ids.is_contiguous() && offsets.is_contiguous(),
              "block_ids and offsets: one int64 each a row");
  const int64_t* block_of = block_ids.data_ptr<int64_t>();
  const int64_t* offset_of = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(block_of[r] >= 0 && block_of[r] < cache.size(0) && offset_of[r] >= 0 &&
                    offset_of[r] < block,
                "row " + std::to_string(r) + ": slot (" + std::to_string(block_of[r]) + ", " +
                    std::to_string(offset_of[r]) + ") is outside the cache");
  float* base = qkv.data_ptr<float>();
  float* kv = cache.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0), page = cache.stride(0), v_offset = cache.stride(1);
  const int64_t row_stride = cache.stride(2);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> head(dim);
    for (int64_t r = begin; r < end; ++r) {
      float* q = base + r * stride;
      const float *cr = c + r * dim, *sr = s + r * dim;
      // q and k rotate in place (attention of a prompt chunk reads them from qkv); the rotated
      // k and the plain v are what the cache keeps.
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        rotate(q + h * dim, cr, sr, head.data(), dim);
        std::copy(head.begin(), head.end(), q + h * dim);
      }
      const float* k = q + num_heads * dim;
      const float* v = k + kv_heads * dim;
      float* slot = kv + block_of[r] * page + offset_of[r] * row_stride;
      std::copy(k, k + kv_heads * dim, slot);
      std::copy(v, v + kv_heads * dim, slot + v_offset);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up_any) {
  const auto gate_up = gate_up_any.contiguous();
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width, "gate_up holds gate and up side by side");
  auto out = at::empty({rows, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = src + r * stride, *up = gate + width;
      float* o = dst + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// The CPU kernels of one extension module (engine/cpu_kernels.py builds them together).
#pragma once

#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lens);

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps);

void rope_store_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& cache, const at::Tensor& block_ids, const at::Tensor& offsets,
                    int64_t num_heads);

at::Tensor silu_mul(const at::Tensor& gate_up);

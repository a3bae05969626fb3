// The CPU kernels of one extension module (engine/cpu_kernels.py builds them together).
#pragma once

#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lens);

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins);

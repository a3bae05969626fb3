// Decode attention on the CPU over the paged KV cache, read in place.
//
// One query token per request. Each task is (request, chunk of the context): it walks the
// chunk's blocks through the request's block table and, for each query head, scores the whole
// chunk against the K rows where the cache holds them, then takes the chunk's softmax (one max,
// one exp pass) and its weighted V rows, in float. A second pass merges the chunks of each head
// by their maxima and sums. Every K and V byte of the context is read once; nothing is
// gathered, masked or padded, so the cost of a step follows its context's bytes. Splitting the
// context into chunks keeps both cores busy when a single request is decoding. (A running
// softmax rescaled block by block cost 1.25x as much: a max, an exp and a rescale of the
// accumulator per 16-token block and head.)
//
// cache: one layer's view [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]; the page
// stride is free (the real cache is block-major over all layers), the rest is contiguous.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Context tokens per task: a request at 2,048 tokens makes 32 tasks, enough to keep every core
// streaming memory; each task reads whole blocks (all KV heads), front to back.
constexpr int64_t kChunkTokens = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void add_scaled(float* acc, float a, const T* v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += a * static_cast<float>(v[i]);
}

inline void scale(float* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// One query head against a block's n K rows (row: the stride between them), and the block's
// weighted V rows added into acc: any cache dtype and head size.
template <typename T>
struct BlockOps {
  static void score(const float* q, const T* k, int64_t row, int64_t n, int64_t dim,
                    float* scores) {
    for (int64_t j = 0; j < n; ++j) scores[j] = dot(q, k + j * row, dim);
  }
  static void accumulate(float* acc, const float* weights, const T* v, int64_t row, int64_t n,
                         int64_t dim) {
    for (int64_t j = 0; j < n; ++j) add_scaled(acc, weights[j], v + j * row, dim);
  }
};

// The same for a float32 cache and a head of kVectors * 8 values, with AVX2 (every build has
// it): q and acc stay in registers across the block, four keys are scored at once and reduced
// together, so a key costs its loads and FMAs instead of a horizontal sum and a reload of acc.
// At 256 tokens of context the generic loops spent ~100 us a layer on one core, ~10x the FMAs.
template <int kVectors>
struct FloatBlockOps {
  static void score(const float* q, const float* k, int64_t row, int64_t n, int64_t /*dim*/,
                    float* scores) {
    __m256 qv[kVectors];
    for (int c = 0; c < kVectors; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m256 s[4];
      for (int r = 0; r < 4; ++r) {
        const float* kr = k + (j + r) * row;
        s[r] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
        for (int c = 1; c < kVectors; ++c)
          s[r] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), s[r]);
      }
      // Lanes of s[r] summed: two rounds of pairwise adds leave each half holding the four
      // keys' partial sums, the halves added give the four scores in order.
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
      _mm_storeu_ps(scores + j, _mm_add_ps(_mm256_castps256_ps128(pairs),
                                           _mm256_extractf128_ps(pairs, 1)));
    }
    for (; j < n; ++j) scores[j] = dot(q, k + j * row, 8 * kVectors);
  }
  static void accumulate(float* acc, const float* weights, const float* v, int64_t row, int64_t n,
                         int64_t /*dim*/) {
    __m256 a[kVectors];
    for (int c = 0; c < kVectors; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(weights[j]);
      for (int c = 0; c < kVectors; ++c)
        a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * row + 8 * c), a[c]);
    }
    for (int c = 0; c < kVectors; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
  }
};

// Partial softmax states of every task: max, sum and the weighted V rows of its query heads.
struct Partials {
  std::vector<float> max, sum, acc;
  Partials(int64_t tasks, int64_t group, int64_t head_dim)
      : max(tasks * group, kNegInf), sum(tasks * group, 0.f), acc(tasks * group * head_dim, 0.f) {}
};

template <typename T, typename Ops>
void attend(const at::Tensor& q_scaled, const at::Tensor& cache, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out) {
  const int64_t batch = q_scaled.size(0), heads = q_scaled.size(1), dim = q_scaled.size(2);
  const int64_t block = cache.size(2), kv_heads = cache.size(3), group = heads / kv_heads;
  const int64_t page = cache.stride(0), v_offset = cache.stride(1), row = cache.stride(2);
  const int64_t width = tables.size(1);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const float* q = q_scaled.data_ptr<float>();
  const T* base = cache.data_ptr<T>();

  const int64_t longest = *std::max_element(len, len + batch);
  const int64_t chunks = std::max<int64_t>(1, (longest + kChunkTokens - 1) / kChunkTokens);
  const int64_t tasks = batch * chunks;
  Partials part(tasks, heads, dim);

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunkTokens);
    std::vector<const T*> starts;  // the chunk's runs of rows, one per block it touches
    std::vector<int64_t> counts;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, first = (task % chunks) * kChunkTokens;
      const int64_t last = std::min<int64_t>(len[b], first + kChunkTokens);
      if (first >= last) continue;  // past this request's context: its state stays empty
      starts.clear();
      counts.clear();
      for (int64_t t = first; t < last;) {
        const int64_t offset = t % block, n = std::min(block - offset, last - t);
        starts.push_back(base + table[b * width + t / block] * page + offset * row);
        counts.push_back(n);
        t += n;
      }
      const int64_t num_tokens = last - first;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = h * group + g;
          const float* qh = q + (b * heads + head) * dim;
          float* s = scores.data();
          for (size_t i = 0; i < starts.size(); ++i) {
            Ops::score(qh, starts[i] + h * dim, row, counts[i], dim, s);
            s += counts[i];
          }
          const float chunk_max = *std::max_element(scores.begin(), scores.begin() + num_tokens);
          float chunk_sum = 0.f;
#pragma omp simd reduction(+ : chunk_sum)
          for (int64_t j = 0; j < num_tokens; ++j) {
            scores[j] = std::exp(scores[j] - chunk_max);
            chunk_sum += scores[j];
          }
          const int64_t state = task * heads + head;
          float* acc = part.acc.data() + state * dim;
          s = scores.data();
          for (size_t i = 0; i < starts.size(); ++i) {
            Ops::accumulate(acc, s, starts[i] + h * dim + v_offset, row, counts[i], dim);
            s += counts[i];
          }
          part.max[state] = chunk_max;
          part.sum[state] = chunk_sum;
        }
      }
    }
  });

  // Merge each query head's chunks: weights exp(chunk max - overall max).
  float* o = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, head = bh % heads;
      auto state_of = [&](int64_t c) { return (b * chunks + c) * heads + head; };
      float overall = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) overall = std::max(overall, part.max[state_of(c)]);
      float total = 0.f;
      float* out_row = o + bh * dim;
      std::fill(out_row, out_row + dim, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t state = state_of(c);
        if (part.sum[state] == 0.f) continue;  // a chunk past this request's context
        const float w = std::exp(part.max[state] - overall);
        total += w * part.sum[state];
        add_scaled(out_row, w, part.acc.data() + state * dim, dim);
      }
      scale(out_row, 1.f / total, dim);
    }
  });
}

}  // namespace

// q: [batch, heads, head_dim]; tables: [batch, width] int32 block ids, each row valid up to its
// length's blocks; lens: [batch] int32 context lengths (>= 1). Returns [batch, heads, head_dim]
// in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && tables.dim() == 2 && lens.dim() == 1,
              "q [B, H, D], cache [blocks, 2, block_size, Hkv, D], tables [B, W], lens [B]");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "block tables and lengths are int32");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "contiguous tables and lengths");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(cache.size(1) == 2 && cache.size(4) == dim && heads % cache.size(3) == 0,
              "cache shape does not match the queries");
  TORCH_CHECK(cache.stride(4) == 1 && cache.stride(3) == dim &&
                  cache.stride(2) == cache.size(3) * dim &&
                  cache.stride(1) == cache.size(2) * cache.stride(2),
              "each block of the layer view must be contiguous");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one table and length a row");
  auto out = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  if (batch == 0) return out.to(q.scalar_type());
  // Softmax scale folded into the queries, once per call instead of once per key.
  const auto q_scaled =
      q.to(at::kFloat).mul(1.0 / std::sqrt(static_cast<double>(dim))).contiguous();
  switch (cache.scalar_type()) {
    case at::kFloat:
      if (dim == 64)
        attend<float, FloatBlockOps<8>>(q_scaled, cache, tables, lens, out);
      else if (dim == 128)
        attend<float, FloatBlockOps<16>>(q_scaled, cache, tables, lens, out);
      else
        attend<float, BlockOps<float>>(q_scaled, cache, tables, lens, out);
      break;
    case at::kBFloat16:
      attend<c10::BFloat16, BlockOps<c10::BFloat16>>(q_scaled, cache, tables, lens, out);
      break;
    case at::kHalf:
      attend<c10::Half, BlockOps<c10::Half>>(q_scaled, cache, tables, lens, out);
      break;
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16 or float16");
  }
  return out.to(q.scalar_type());
}

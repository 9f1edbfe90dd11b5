// Paged decode attention for CPUs: one pass over each sequence's KV blocks, straight from the
// paged cache (no gather copy), online softmax per block, GQA heads of a KV head together.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename scalar_t, int64_t kD>
void decode_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ kc,
                   const scalar_t* __restrict__ vc, const int32_t* __restrict__ seq_lens,
                   const int32_t* __restrict__ tables, scalar_t* __restrict__ out,
                   int64_t B, int64_t H, int64_t KVH, int64_t D_runtime, int64_t BS, int64_t max_blocks,
                   float scale) {
  // kD > 0: head_dim known at compile time, so the inner loops unroll and vectorise fully.
  const int64_t D = kD > 0 ? kD : D_runtime;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // elements between consecutive tokens of one block
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qv(G * D), acc(G * D), scores(G * BS), m(G), l(G);
    std::vector<float> kbuf(BS * D), vbuf(BS * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH;
      const int64_t len = seq_lens[b];
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* qs = q + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qv[g * D + d] = to_f(qs[d]) * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* table = tables + b * max_blocks;
      for (int64_t start = 0; start < len; start += BS) {
        const int64_t n = std::min(BS, len - start);
        const int64_t base = (static_cast<int64_t>(table[start / BS]) * BS) * row + h * D;
        const float* kp;
        const float* vp;
        if constexpr (std::is_same_v<scalar_t, float>) {
          kp = kc + base;
          vp = vc + base;
        } else {
          for (int64_t t = 0; t < n; ++t)
            for (int64_t d = 0; d < D; ++d) {
              kbuf[t * D + d] = to_f(kc[base + t * row + d]);
              vbuf[t * D + d] = to_f(vc[base + t * row + d]);
            }
          kp = kbuf.data();
          vp = vbuf.data();
        }
        const int64_t stride = std::is_same_v<scalar_t, float> ? row : D;
        // Scores of every head of the group against the block, K rows read once.
        for (int64_t t = 0; t < n; ++t) {
          const float* kt = kp + t * stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qv.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
            scores[g * BS + t] = s;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * BS;
          float block_max = sg[0];
          for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sg[t]);
          const float new_m = std::max(m[g], block_max);
          const float corr = std::exp(m[g] - new_m);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = std::exp(sg[t] - new_m);
            sum += sg[t];
          }
          l[g] = l[g] * corr + sum;
          m[g] = new_m;
          float* ag = acc.data() + g * D;
          if (corr != 1.f) {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          }
        }
        // P @ V, V rows read once for the whole group.
        for (int64_t t = 0; t < n; ++t) {
          const float* vt = vp + t * stride;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * BS + t];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = out + (b * H + h * G + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

// query [B, H, D]; kv_cache [2, num_blocks, block_size, kv_heads, D]; out [B, H, D].
void paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor seq_lens,
                            torch::Tensor block_tables, double scale, torch::Tensor out) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention needs contiguous query, cache and output");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32,
              "seq_lens and block_tables must be int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode", [&] {
    const scalar_t* kc = kv_cache.data_ptr<scalar_t>();
    auto run = [&](auto kernel) {
      kernel(query.data_ptr<scalar_t>(), kc, kc + NB * BS * KVH * D, lens.data_ptr<int32_t>(),
             tables.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, BS,
             tables.size(1), static_cast<float>(scale));
    };
    switch (D) {
      case 64: run(decode_kernel<scalar_t, 64>); break;
      case 128: run(decode_kernel<scalar_t, 128>); break;
      default: run(decode_kernel<scalar_t, 0>); break;
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}

// Paged decode attention for CPUs: reads each sequence's KV blocks in place from the paged
// cache (no gather copy). Two passes: the scores of every query head against all of the
// sequence's K rows, one softmax per head, then P @ V; each block's rows are read from memory
// once and reused from L1 by every query head that shares them (GQA). head_dim is a
// compile-time constant for the common sizes, so the inner loops are plain unrolled FMAs; exp
// is a polynomial the compiler vectorises (libm's expf is not, under these flags). A thread takes
// whole sequences; fewer sequences than threads are cut into slices of blocks. A sequence's blocks
// lie anywhere in the cache (decoding sequences take blocks in turn), and the hardware prefetcher
// stops at each one's end: the rows of the block PREFETCH_AHEAD blocks on are prefetched a row per
// row computed, K's then V's (a block's worth at once overruns the misses a core keeps in flight
// and gains nothing; a row at a time took a batch of 12 x 770 tokens from 1.05 to 0.66 ms a layer
// on a 2-core Zen 4). Also here:
// rotary embedding and store_kv, the model's other per-layer ops on CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// An fp8 cache's values (--kv-cache-dtype fp8 / fp8_e5m2) as floats, exactly (every fp8 value is
// one), NaN and e5m2's infinities included, and whatever the FTZ / DAZ modes (no subnormal is
// computed with). One value: the magnitude's bits rebiased into float's fields, subnormals as
// their mantissa times 2^-9 (e4m3) or 2^-16 (e5m2).
template <bool kE4M3>
inline float fp8_to_float(uint8_t b) {
  constexpr uint32_t kMant = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15;
  const uint32_t mag = b & 0x7Fu;
  float v;
  if (kE4M3 ? mag == 0x7Fu : mag > 0x7Cu) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (!kE4M3 && mag == 0x7Cu) {
    v = std::numeric_limits<float>::infinity();
  } else if (mag >> kMant == 0) {
    v = static_cast<float>(mag) * (kE4M3 ? 0x1p-9f : 0x1p-16f);
  } else {
    const uint32_t bits = (mag << (23 - kMant)) + ((127 - kBias) << 23);
    std::memcpy(&v, &bits, sizeof(v));
  }
  return b & 0x80u ? -v : v;
}

// n of them, eight at a time through the CPU's half-precision conversion where it has one (F16C):
// e5m2 is a half's top byte; e4m3's bits placed in a half's fields make 2^-8 of its value (its
// subnormals a half's subnormals, which the conversion takes exactly), NaN set before.
template <typename T>
inline void widen_fp8(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  constexpr bool kE4M3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  const uint8_t* __restrict__ bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const __m128i mag_mask = _mm_set1_epi16(0x7F), sign_mask = _mm_set1_epi16(0x80);
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (kE4M3) {
      const __m128i mag = _mm_and_si128(b, mag_mask);
      __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(b, sign_mask), 8));
      h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, mag_mask));  // 0x7f: NaN
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(0x1p8f)));
    } else {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = fp8_to_float<kE4M3>(bytes[i]);
}

// n cache elements as floats: fp8 as above, half and bfloat16 by their own conversions.
template <typename cache_t>
inline void widen(const cache_t* __restrict__ src, float* __restrict__ dst, int64_t n) {
  if constexpr (sizeof(cache_t) == 1) {
    widen_fp8(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
  }
}

// Calls f with a value of the cache's element type: the query's own, or an fp8 format (for
// float, half and bfloat16 queries). The kernels widen a cache of another type than float a block
// or a tile at a time, so an fp8 cache is read in place as a half or bfloat16 one is.
template <typename scalar_t, typename F>
void dispatch_cache(const torch::Tensor& cache, F&& f) {
  const auto c = cache.scalar_type();
  if (c == c10::CppTypeToScalarType<scalar_t>::value) return f(scalar_t{});
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (c == at::kFloat8_e4m3fn) return f(c10::Float8_e4m3fn{});
    if (c == at::kFloat8_e5m2) return f(c10::Float8_e5m2{});
  }
  TORCH_CHECK(false, "a ", c, " cache with a ", c10::CppTypeToScalarType<scalar_t>::value,
              " query: the cache must be the query's dtype or fp8 (e4m3fn, e5m2)");
}

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6
// minimax polynomial (Cephes expf), relative error about 2e-7; 0 below the float range.
#pragma omp declare simd notinbranch
inline float exp_nonpos(float x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * kLog2e + 0.5f);
  const float r = xc - n * kLn2Hi - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}

// One softmax row, unnormalised: row <- exp(row - max(row)); sets mx to the max (-inf if empty)
// and returns the sum of the exponentials (0 if empty).
inline float exp_shifted(float* __restrict__ row, int64_t len, float& mx) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < len; ++t) m = std::max(m, row[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    const float e = exp_nonpos(row[t] - m);
    row[t] = e;
    sum += e;
  }
  mx = m;
  return sum;
}

// One decode call: pointers into the contiguous tensors, and the sizes derived from them.
template <typename scalar_t, typename cache_t>
struct DecodeArgs {
  const scalar_t* __restrict__ q;   // [B, H, D]
  const cache_t* __restrict__ kc;   // K blocks [num_blocks, BS, KVH, D]
  const cache_t* __restrict__ vc;   // V blocks, same shape
  const int32_t* __restrict__ seq_lens;
  const int32_t* __restrict__ tables;  // [B, max_blocks]
  scalar_t* __restrict__ out;          // [B, H, D]
  int64_t B, H, D, BS, max_blocks;
  float scale;
  int64_t G;        // query heads per KV head
  int64_t row;      // elements between consecutive tokens of one block (KVH * D)
  int64_t max_len;  // the longest sequence: per-thread score buffers are sized by it
  int64_t window;   // > 0: the query sees its sequence's last `window` keys only (sliding window)
  float softcap;    // > 0: scores softcap * tanh(score / softcap)
};

constexpr int64_t PREFETCH_AHEAD = 2;  // blocks

// Prefetches one row (a token's kv_heads x D elements) into L1.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// One work item per (sequence, slice of its blocks), all heads: each block's K (then V) rows are
// read once, front to back (kv_heads x D contiguous per token), which streams about twice as fast
// as one head's strided slice of them. A batch of fewer sequences than threads cuts each sequence's
// blocks into `splits` slices (flash-decoding): a slice keeps its max, sum and unnormalised output
// per head, and the slices are merged at the end.
template <typename scalar_t, typename cache_t, int64_t kD>
void decode_sequences(const DecodeArgs<scalar_t, cache_t>& a, int64_t splits) {
  const int64_t D = kD > 0 ? kD : a.D;  // kD > 0: known at compile time, inner loops unrolled
  constexpr bool kFloat = std::is_same_v<cache_t, float>;
  const int64_t slice_cap = (((a.max_len + a.BS - 1) / a.BS + splits - 1) / splits) * a.BS;
  std::vector<float> part_max, part_sum, part_acc;  // [B, splits, H] and [B, splits, H, D]
  if (splits > 1) {
    part_max.resize(a.B * splits * a.H);
    part_sum.resize(a.B * splits * a.H);
    part_acc.resize(a.B * splits * a.H * D);
  }
  at::parallel_for(0, a.B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qv(a.H * D), acc(a.H * D), scores(a.H * std::max<int64_t>(slice_cap, 1));
    std::vector<float> mx(a.H), sum(a.H);
    std::vector<float> buf(kFloat ? 0 : a.BS * a.row);
    // A block's rows: in place for float caches, else (half, bf16, fp8) converted into buf.
    auto block = [&](const cache_t* p, int64_t n) -> const float* {
      if constexpr (kFloat) {
        return p;
      } else {
        widen(p, buf.data(), n * a.row);
        return buf.data();
      }
    };
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / splits, s = idx % splits;
      const int64_t len = a.seq_lens[b];
      // A sliding window: the keys from lo on, the slices cut from lo's block (its earlier keys masked).
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, base = lo / a.BS * a.BS;
      const int64_t per = ((len - base + a.BS - 1) / a.BS + splits - 1) / splits;  // blocks per slice
      const int64_t first = std::min(len, base + s * per * a.BS), last = std::min(len, base + (s + 1) * per * a.BS);
      const int64_t n_tok = last - first;
      const int32_t* table = a.tables + b * a.max_blocks;
      const scalar_t* qs = a.q + b * a.H * D;
      for (int64_t i = 0; i < a.H * D; ++i) qv[i] = to_f(qs[i]) * a.scale;
      // The slice's blocks in order, K's then V's: the one PREFETCH_AHEAD on from `i` (nullptr past them).
      const int64_t n_blocks = (n_tok + a.BS - 1) / a.BS;
      auto ahead = [&](int64_t i) -> const cache_t* {
        const int64_t j = i + PREFETCH_AHEAD;
        if (j >= 2 * n_blocks) return nullptr;
        const cache_t* cache = j < n_blocks ? a.kc : a.vc;
        return cache + static_cast<int64_t>(table[first / a.BS + j % n_blocks]) * a.BS * a.row;
      };
      // Pass 1: scores[hq][t] = q_hq . k_t over the slice.
      for (int64_t start = first; start < last; start += a.BS) {
        const int64_t n = std::min(a.BS, last - start);
        const cache_t* next = ahead((start - first) / a.BS);
        const float* kp = block(a.kc + static_cast<int64_t>(table[start / a.BS]) * a.BS * a.row, n);
        for (int64_t t = 0; t < n; ++t) {
          if (next) prefetch_row(next + t * a.row, a.row);
          for (int64_t hq = 0; hq < a.H; ++hq) {
            const float* __restrict__ kt = kp + t * a.row + (hq / a.G) * D;
            const float* __restrict__ qg = qv.data() + hq * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
            if (a.softcap > 0.f) dot = a.softcap * std::tanh(dot / a.softcap);
            scores[hq * n_tok + start - first + t] = start + t < lo ? -std::numeric_limits<float>::infinity() : dot;
          }
        }
      }
      for (int64_t hq = 0; hq < a.H; ++hq) sum[hq] = exp_shifted(scores.data() + hq * n_tok, n_tok, mx[hq]);
      // Pass 2: acc_hq = sum_t p_hq[t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = first; start < last; start += a.BS) {
        const int64_t n = std::min(a.BS, last - start);
        const cache_t* next = ahead(n_blocks + (start - first) / a.BS);
        const float* vp = block(a.vc + static_cast<int64_t>(table[start / a.BS]) * a.BS * a.row, n);
        for (int64_t t = 0; t < n; ++t) {
          if (next) prefetch_row(next + t * a.row, a.row);
          for (int64_t hq = 0; hq < a.H; ++hq) {
            const float p = scores[hq * n_tok + start - first + t];
            const float* __restrict__ vt = vp + t * a.row + (hq / a.G) * D;
            float* __restrict__ ag = acc.data() + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
          }
        }
      }
      if (splits == 1) {
        scalar_t* o = a.out + b * a.H * D;
        for (int64_t hq = 0; hq < a.H; ++hq) {
          const float inv = sum[hq] > 0.f ? 1.f / sum[hq] : 0.f;
          for (int64_t d = 0; d < D; ++d) o[hq * D + d] = static_cast<scalar_t>(acc[hq * D + d] * inv);
        }
      } else {
        const int64_t at = (b * splits + s) * a.H;
        std::copy(mx.begin(), mx.end(), part_max.begin() + at);
        std::copy(sum.begin(), sum.end(), part_sum.begin() + at);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + at * D);
      }
    }
  });
  if (splits == 1) return;
  // Merge the slices: rescale each to the largest max, then normalise once.
  at::parallel_for(0, a.B * a.H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / a.H, hq = idx % a.H;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (b * splits + s) * a.H + hq;
        if (part_sum[at] > 0.f) m = std::max(m, part_max[at]);
      }
      float total = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (b * splits + s) * a.H + hq;
        if (!(part_sum[at] > 0.f)) continue;  // an empty slice
        const float w = std::exp(part_max[at] - m);
        total += w * part_sum[at];
        const float* __restrict__ pa = part_acc.data() + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * pa[d];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      scalar_t* out = a.out + (b * a.H + hq) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(o[d] * inv);
    }
  });
}

// Every block a sequence's keys reach must lie in the cache: a stray id would read another
// process's memory rather than fail. Only the blocks the sequences reach are read; unused table
// entries may hold anything. One pass over the ids in use (1,024 at a batch of 16 sequences of
// 1k tokens in blocks of 16), beside a kernel that reads those blocks' K and V.
void check_block_tables(const int32_t* lp, const torch::Tensor& tables, int64_t B, int64_t BS, int64_t NB) {
  const int64_t width = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && (lp[b] + BS - 1) / BS <= width, "sequence ", b, ": ", lp[b], " keys exceed its block table");
    for (int64_t blk = 0; blk * BS < lp[b]; ++blk) {
      const int32_t id = tp[b * width + blk];
      TORCH_CHECK(id >= 0 && id < NB, "block id ", id, " outside [0, ", NB, ")");
    }
  }
}

}  // namespace

// query [B, H, D]; kv_cache [2, num_blocks, block_size, kv_heads, D]; out [B, H, D].
void paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor seq_lens,
                            torch::Tensor block_tables, double scale, torch::Tensor out, int64_t window,
                            double softcap) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention needs contiguous query, cache and output");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32,
              "seq_lens and block_tables must be int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(4) == D, "kv_cache [2, blocks, block_size, kv_heads, ", D,
              "] expected");
  TORCH_CHECK(lens.numel() == B && tables.dim() == 2 && tables.size(0) == B,
              "seq_lens [B] and block_tables [B, n] expected for ", B, " queries");
  check_block_tables(lens.data_ptr<int32_t>(), tables, B, BS, NB);
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "the output must be the query's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode", [&] {
    dispatch_cache<scalar_t>(kv_cache, [&](auto cache_elem) {
      using cache_t = decltype(cache_elem);
      const cache_t* kc = kv_cache.data_ptr<cache_t>();
      const int32_t* lp = lens.data_ptr<int32_t>();
      const DecodeArgs<scalar_t, cache_t> args{query.data_ptr<scalar_t>(), kc, kc + NB * BS * KVH * D, lp,
                                               tables.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                                               B, H, D, BS, tables.size(1), static_cast<float>(scale),
                                               H / KVH, KVH * D, B ? *std::max_element(lp, lp + B) : 0, window,
                                               static_cast<float>(softcap)};
      // Whole sequences per thread when there are enough to go round; else each sequence's blocks
      // are cut into slices, as many as keep the threads busy, of at least 8 blocks each (shorter
      // ones cost more to merge than they save).
      const int64_t threads = at::get_num_threads();
      const int64_t blocks = (args.max_len + BS - 1) / BS;
      const int64_t splits = B >= threads ? 1 : std::max<int64_t>(1, std::min(threads / std::max<int64_t>(B, 1),
                                                                              blocks / 8));
      auto pick = [&](auto d) { decode_sequences<scalar_t, cache_t, decltype(d)::value>(args, splits); };
      if constexpr (sizeof(cache_t) == 1) {  // fp8: the two commonest head sizes unrolled (build time)
        switch (D) {
          case 64: pick(std::integral_constant<int64_t, 64>{}); break;
          case 128: pick(std::integral_constant<int64_t, 128>{}); break;
          default: pick(std::integral_constant<int64_t, 0>{}); break;
        }
      } else {
        switch (D) {  // the head sizes of common models get fully unrolled inner loops
          case 32: pick(std::integral_constant<int64_t, 32>{}); break;
          case 64: pick(std::integral_constant<int64_t, 64>{}); break;
          case 80: pick(std::integral_constant<int64_t, 80>{}); break;
          case 96: pick(std::integral_constant<int64_t, 96>{}); break;
          case 128: pick(std::integral_constant<int64_t, 128>{}); break;
          case 256: pick(std::integral_constant<int64_t, 256>{}); break;
          default: pick(std::integral_constant<int64_t, 0>{}); break;
        }
      }
    });
  });
}

// Paged prefill attention for CPUs: rows of several query tokens (fresh prompts, chunks after
// earlier context), causal at each sequence's end, as flash attention (an online softmax over
// tiles of keys). Computed transposed, with query rows in the vector lanes: a tile of kRows
// (token, head) rows that share a KV head is held as Q^T [D][kRows]; S^T = K Q^T broadcasts each
// K element against the tile's row vectors, so the softmax's max, exp and sums are elementwise
// across lanes; O^T [D][kRows] += V^T P^T broadcasts each V element the same way. K and V are
// read in place from the paged cache (float; half, bf16 and fp8 a tile at a time converted): only
// the query tile is transposed in, and the output out, once each. SDPA's CPU flash kernel does
// ~150-180 GFLOP/s of causal attention at head size 64 on two AVX-512 cores, this ~1.5x that.
namespace {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
constexpr int64_t kAccs = 16;  // accumulator vectors per micro-step, of 32 registers
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kAccs = 8;  // of 16
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef float vfloat_u __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint_u __attribute__((vector_size(kLanes * 4), aligned(4)));
constexpr int64_t kKeys = 64;  // keys per tile

inline vfloat vload(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void vstore(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }

template <typename scalar_t, typename cache_t>
struct PrefillArgs {
  const scalar_t* __restrict__ q;    // [T, H, D]
  const cache_t* __restrict__ kc;    // K blocks [num_blocks, BS, KVH, D]
  const cache_t* __restrict__ vc;    // V blocks, same shape
  const int64_t* __restrict__ qsl;   // [B + 1] query rows of each sequence
  const int32_t* __restrict__ seq_lens;
  const int32_t* __restrict__ tables;  // [B, max_blocks]
  scalar_t* __restrict__ out;          // [T, H, D]
  int64_t H, D, BS, max_blocks, G, row;
  float scale;
  int64_t window;  // > 0: a row at position p sees keys p - window + 1 .. p only
  float softcap;   // > 0: scores softcap * tanh(score / softcap)
};

// One tile: rows r0 .. r0 + kRows - 1 of one sequence's (token, head-in-group) rows for one KV head.
struct PrefillTile {
  int64_t seq, kvh, r0, keys;
};

template <typename cache_t, int64_t kD, int64_t kRowVecs>
struct PrefillScratch {
  static constexpr int64_t kRows = kRowVecs * kLanes;
  std::vector<float> qt, st, ot, kbuf, vbuf;
  std::vector<const float*> kp, vp;
  float m[kRows], l[kRows], alpha[kRows];
  int32_t qpos[kRows];
  explicit PrefillScratch(int64_t D)
      : qt(D * kRows), st(kKeys * kRows), ot(D * kRows), kbuf(std::is_same_v<cache_t, float> ? 0 : kKeys * D),
        vbuf(kbuf.size()), kp(kKeys), vp(kKeys) {}
};

template <typename scalar_t, typename cache_t, int64_t kD, int64_t kRowVecs>
void prefill_tile(const PrefillArgs<scalar_t, cache_t>& a, const PrefillTile& t,
                  PrefillScratch<cache_t, kD, kRowVecs>& s) {
  constexpr int64_t kRows = kRowVecs * kLanes;
  constexpr int64_t kStep = kAccs / kRowVecs;  // keys (S^T) or dims (O^T) per micro-step
  const int64_t D = kD > 0 ? kD : a.D;
  const int64_t q0 = a.qsl[t.seq], q_len = a.qsl[t.seq + 1] - q0;
  const int64_t seq_len = a.seq_lens[t.seq], ctx = seq_len - q_len;
  const int64_t nrows = std::min(kRows, q_len * a.G - t.r0);
  float* __restrict__ qt = s.qt.data();
  float* __restrict__ st = s.st.data();
  float* __restrict__ ot = s.ot.data();
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < nrows) {
      const int64_t i = (t.r0 + r) / a.G, h = t.kvh * a.G + (t.r0 + r) % a.G;
      const scalar_t* qr = a.q + ((q0 + i) * a.H + h) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = to_f(qr[d]) * a.scale;
      s.qpos[r] = static_cast<int32_t>(ctx + i);
    } else {  // padding lanes: see every key, their results are dropped
      for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = 0.f;
      s.qpos[r] = static_cast<int32_t>(seq_len - 1);
    }
    s.m[r] = -1e30f;
    s.l[r] = 0.f;
  }
  std::fill(s.ot.begin(), s.ot.end(), 0.f);
  const int64_t first_pos = ctx + t.r0 / a.G;  // keys up to it are seen by every row
  const int64_t last_pos = ctx + (t.r0 + nrows - 1) / a.G;
  const int32_t* table = a.tables + t.seq * a.max_blocks;
  // A sliding window: no row sees a key before the earliest row's window.
  const int64_t k_begin = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  for (int64_t k0 = k_begin; k0 < t.keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, t.keys - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = k0 + j;
      const int64_t off = (static_cast<int64_t>(table[key / a.BS]) * a.BS + key % a.BS) * a.row + t.kvh * D;
      if constexpr (std::is_same_v<cache_t, float>) {
        s.kp[j] = a.kc + off;
        s.vp[j] = a.vc + off;
      } else {
        float* kb = s.kbuf.data() + j * D;
        float* vb = s.vbuf.data() + j * D;
        widen(a.kc + off, kb, D);
        widen(a.vc + off, vb, D);
        s.kp[j] = kb;
        s.vp[j] = vb;
      }
    }
    // S^T [n][kRows] = K Q^T (the scale is in Q), causally masked where the tile reaches past
    // the earliest row's position, and each row's running max taken on the way out.
    const bool masked = k0 + n - 1 > first_pos;
    const bool banded = a.window > 0 && k0 <= last_pos - a.window;  // a row's window starts past k0
    const int32_t window = static_cast<int32_t>(a.window);
    vfloat mx[kRowVecs];
    vint pos[kRowVecs];
    for (int64_t x = 0; x < kRowVecs; ++x) {
      mx[x] = vload(s.m + x * kLanes);
      pos[x] = *reinterpret_cast<const vint_u*>(s.qpos + x * kLanes);
    }
    const vfloat ninf = vfloat{} - std::numeric_limits<float>::infinity();
    auto emit = [&](int64_t key, int64_t at, vfloat* acc) {
      for (int64_t x = 0; x < kRowVecs; ++x) {
        if (a.softcap > 0.f)
          for (int64_t l = 0; l < kLanes; ++l) acc[x][l] = a.softcap * std::tanh(acc[x][l] / a.softcap);
        if (masked) acc[x] = (pos[x] < static_cast<int32_t>(key)) ? ninf : acc[x];
        if (banded) acc[x] = (pos[x] - window >= static_cast<int32_t>(key)) ? ninf : acc[x];
        mx[x] = mx[x] > acc[x] ? mx[x] : acc[x];
        vstore(st + at * kRows + x * kLanes, acc[x]);
      }
    };
    int64_t j = 0;
    for (; j + kStep <= n; j += kStep) {
      vfloat acc[kStep][kRowVecs] = {};
      for (int64_t d = 0; d < D; ++d) {
        vfloat qv[kRowVecs];
        for (int64_t x = 0; x < kRowVecs; ++x) qv[x] = vload(qt + d * kRows + x * kLanes);
        for (int64_t jj = 0; jj < kStep; ++jj) {
          const float kb = s.kp[j + jj][d];
          for (int64_t x = 0; x < kRowVecs; ++x) acc[jj][x] += kb * qv[x];
        }
      }
      for (int64_t jj = 0; jj < kStep; ++jj) emit(k0 + j + jj, j + jj, acc[jj]);
    }
    for (; j < n; ++j) {
      vfloat acc[kRowVecs] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float kb = s.kp[j][d];
        for (int64_t x = 0; x < kRowVecs; ++x) acc[x] += kb * vload(qt + d * kRows + x * kLanes);
      }
      emit(k0 + j, j, acc);
    }
    // Online softmax, elementwise over the rows.
    float mt[kRows], lsum[kRows];
    for (int64_t x = 0; x < kRowVecs; ++x) vstore(mt + x * kLanes, mx[x]);
#pragma omp simd
    for (int64_t r = 0; r < kRows; ++r) {
      s.alpha[r] = exp_nonpos(s.m[r] - mt[r]);
      s.m[r] = mt[r];
      lsum[r] = 0.f;
    }
    for (int64_t jj = 0; jj < n; ++jj) {
      float* __restrict__ sr = st + jj * kRows;
#pragma omp simd
      for (int64_t r = 0; r < kRows; ++r) {
        const float e = exp_nonpos(sr[r] - mt[r]);
        sr[r] = e;
        lsum[r] += e;
      }
    }
#pragma omp simd
    for (int64_t r = 0; r < kRows; ++r) s.l[r] = s.l[r] * s.alpha[r] + lsum[r];
    // O^T = O^T * alpha + V^T P^T, kStep dims at a time.
    vfloat av[kRowVecs];
    for (int64_t x = 0; x < kRowVecs; ++x) av[x] = vload(s.alpha + x * kLanes);
    int64_t d0 = 0;
    for (; d0 + kStep <= D; d0 += kStep) {
      vfloat acc[kStep][kRowVecs];
      for (int64_t dd = 0; dd < kStep; ++dd)
        for (int64_t x = 0; x < kRowVecs; ++x) acc[dd][x] = vload(ot + (d0 + dd) * kRows + x * kLanes) * av[x];
      for (int64_t jj = 0; jj < n; ++jj) {
        vfloat pv[kRowVecs];
        for (int64_t x = 0; x < kRowVecs; ++x) pv[x] = vload(st + jj * kRows + x * kLanes);
        const float* __restrict__ vr = s.vp[jj] + d0;
        for (int64_t dd = 0; dd < kStep; ++dd) {
          const float vb = vr[dd];
          for (int64_t x = 0; x < kRowVecs; ++x) acc[dd][x] += vb * pv[x];
        }
      }
      for (int64_t dd = 0; dd < kStep; ++dd)
        for (int64_t x = 0; x < kRowVecs; ++x) vstore(ot + (d0 + dd) * kRows + x * kLanes, acc[dd][x]);
    }
    for (; d0 < D; ++d0) {
      vfloat acc[kRowVecs];
      for (int64_t x = 0; x < kRowVecs; ++x) acc[x] = vload(ot + d0 * kRows + x * kLanes) * av[x];
      for (int64_t jj = 0; jj < n; ++jj) {
        const float vb = s.vp[jj][d0];
        for (int64_t x = 0; x < kRowVecs; ++x) acc[x] += vb * vload(st + jj * kRows + x * kLanes);
      }
      for (int64_t x = 0; x < kRowVecs; ++x) vstore(ot + d0 * kRows + x * kLanes, acc[x]);
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = (t.r0 + r) / a.G, h = t.kvh * a.G + (t.r0 + r) % a.G;
    scalar_t* o = a.out + ((q0 + i) * a.H + h) * D;
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(ot[d * kRows + r] * inv);
  }
}

// The tiles, longest key range first, handed out one at a time (causal tiles differ in cost up
// to the sequence's length: a static split would leave one thread with the heavy end).
template <typename scalar_t, typename cache_t, int64_t kD, int64_t kRowVecs>
void prefill_sequences(const PrefillArgs<scalar_t, cache_t>& a, int64_t B, int64_t KVH) {
  constexpr int64_t kRows = kRowVecs * kLanes;
  std::vector<PrefillTile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b], ctx = a.seq_lens[b] - q_len;
    for (int64_t r0 = 0; r0 < q_len * a.G; r0 += kRows) {
      const int64_t last = std::min(q_len * a.G, r0 + kRows) - 1;
      for (int64_t h = 0; h < KVH; ++h) tiles.push_back({b, h, r0, ctx + last / a.G + 1});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const PrefillTile& x, const PrefillTile& y) {
    return x.kvh != y.kvh ? x.kvh < y.kvh : x.keys > y.keys;
  });
  const int64_t n = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch<cache_t, kD, kRowVecs> scratch(kD > 0 ? kD : a.D);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1))
        prefill_tile<scalar_t, cache_t, kD, kRowVecs>(a, tiles[i], scratch);
  });
}

}  // namespace

// query [T, H, D] (the prefill rows of a step, each sequence's rows together); kv_cache [2,
// num_blocks, block_size, kv_heads, D] already holding these rows' K/V; query_start_loc [B + 1];
// seq_lens [B] (each sequence's keys: its earlier context, then its query rows); out [T, H, D].
void paged_prefill_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor query_start_loc,
                             torch::Tensor seq_lens, torch::Tensor block_tables, double scale, torch::Tensor out,
                             int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [T, H, D] and kv_cache [2, blocks, block_size, kv_heads, D] expected");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes(),
              "paged_prefill_attention needs contiguous query, cache and output of the query's shape");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "the output must be the query's dtype");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32,
              "seq_lens and block_tables must be int32");
  auto qsl = query_start_loc.to(torch::kLong).contiguous();
  auto lens = seq_lens.contiguous();
  auto tables = block_tables.contiguous();
  const int64_t B = lens.size(0), H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "cache heads/head_dim do not match the query's");
  TORCH_CHECK(qsl.numel() == B + 1 && tables.size(0) == B, "query_start_loc [B + 1] and block_tables [B, n] expected");
  const int64_t* qp = qsl.data_ptr<int64_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  TORCH_CHECK(qp[0] == 0 && qp[B] == query.size(0), "query_start_loc must span the query's rows");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qp[b + 1] - qp[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lp[b], "sequence ", b, ": ", q_len, " query rows but ", lp[b], " keys");
  }
  check_block_tables(lp, tables, B, BS, NB);
  const int32_t* tp = tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_prefill", [&] {
    dispatch_cache<scalar_t>(kv_cache, [&](auto cache_elem) {
      using cache_t = decltype(cache_elem);
      const cache_t* kc = kv_cache.data_ptr<cache_t>();
      const PrefillArgs<scalar_t, cache_t> args{query.data_ptr<scalar_t>(), kc, kc + NB * BS * KVH * D, qp, lp, tp,
                                                out.data_ptr<scalar_t>(), H, D, BS, tables.size(1), H / KVH,
                                                KVH * D, static_cast<float>(scale), window,
                                                static_cast<float>(softcap)};
      // Tiles of 4 vectors of rows up to head size 64, 2 above: Q^T and O^T stay L1-sized.
      switch (D) {
        case 64: prefill_sequences<scalar_t, cache_t, 64, 4>(args, B, KVH); break;
        case 128: prefill_sequences<scalar_t, cache_t, 128, 2>(args, B, KVH); break;
        default:
          if (D <= 64) prefill_sequences<scalar_t, cache_t, 0, 4>(args, B, KVH);
          else prefill_sequences<scalar_t, cache_t, 0, 2>(args, B, KVH);
      }
    });
  });
}

// Rotary embedding of query [T, heads, D] and key [T, kv_heads, D] (any strides: they are
// usually views into the fused QKV output) into new contiguous tensors, rotating the first
// rot_dim dims with cos_sin_cache [max_pos, rot_dim] (cos halves, then sin halves): dims i and
// half + i as a pair (Neox style), or, interleaved, dims 2i and 2i + 1 (GPT-J style: GLM's).
// Products and sums are rounded one by one (no FMA contraction), as torch computes them, so
// the result is bit-identical to kernels.reference for float32.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

template <typename scalar_t, typename cs_t>
void rotate(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t T, int64_t heads, int64_t D,
            int64_t st, int64_t sh, const int64_t* __restrict__ pos, const cs_t* __restrict__ cs, int64_t rot,
            bool interleaved) {
  const int64_t half = rot / 2;
  // The pair of element i: (i, half + i), or interleaved (2i, 2i + 1).
  const int64_t step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      const cs_t* row = cs + pos[t] * rot;
      for (int64_t i = 0; i < half; ++i) {
        c[i] = to_f(row[i]);
        s[i] = to_f(row[half + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* __restrict__ xh = x + t * st + h * sh;
        scalar_t* __restrict__ yh = y + (t * heads + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(xh[step * i]), x2 = to_f(xh[step * i + other]);
          const float a = x1 * c[i], b = x2 * s[i], u = x2 * c[i], v = x1 * s[i];
          yh[step * i] = static_cast<scalar_t>(a - b);
          yh[step * i + other] = static_cast<scalar_t>(u + v);
        }
        for (int64_t i = rot; i < D; ++i) yh[i] = xh[i];
      }
    }
  });
}

}  // namespace
#pragma GCC pop_options

std::vector<torch::Tensor> rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                                            torch::Tensor cos_sin_cache, bool interleaved) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) &&
              query.size(2) == key.size(2), "query [T, heads, D] and key [T, kv_heads, D] expected");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key dtypes differ");
  TORCH_CHECK(cos_sin_cache.dim() == 2, "cos_sin_cache [max_pos, rot_dim] expected");
  const int64_t rot = cos_sin_cache.size(1), D = query.size(2);
  TORCH_CHECK(rot % 2 == 0 && rot <= D, "rot_dim ", rot, " does not fit head_dim ", D);
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == query.scalar_type(),
              "cos_sin_cache must be float32 or the query's dtype");
  auto q = query.stride(2) == 1 ? query : query.contiguous();
  auto k = key.stride(2) == 1 ? key : key.contiguous();
  auto cs = cos_sin_cache.contiguous();
  auto pos = positions.to(torch::kLong).contiguous();
  auto q_out = torch::empty(q.sizes(), q.options());
  auto k_out = torch::empty(k.sizes(), k.options());
  const int64_t T = q.size(0), max_pos = cs.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " outside the rotary cache");
  if (T == 0) return {q_out, k_out};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "rotary", [&] {
    auto run = [&](auto* c) {
      rotate(q.data_ptr<scalar_t>(), q_out.data_ptr<scalar_t>(), T, q.size(1), D, q.stride(0), q.stride(1), p, c, rot, interleaved);
      rotate(k.data_ptr<scalar_t>(), k_out.data_ptr<scalar_t>(), T, k.size(1), D, k.stride(0), k.stride(1), p, c, rot, interleaved);
    };
    if (cs.scalar_type() == at::kFloat) run(cs.data_ptr<float>());
    else run(cs.data_ptr<scalar_t>());
  });
  return {q_out, k_out};
}

namespace {

// One K or V row into an fp8 cache as kernels.reference.to_cache_dtype stores it: saturated at the
// format's largest finite value (NaN kept), then rounded to nearest even (c10's conversion, torch's).
template <typename scalar_t, typename cache_t>
void narrow_row(const scalar_t* __restrict__ src, cache_t* __restrict__ dst, int64_t n) {
  const float top = static_cast<float>(std::numeric_limits<cache_t>::max());
  for (int64_t i = 0; i < n; ++i) {
    const float f = to_f(src[i]);
    dst[i] = static_cast<cache_t>(std::isnan(f) ? f : std::clamp(f, -top, top));
  }
}

}  // namespace

// Write new K/V rows [T, kv_heads, D] (views into the fused QKV output are fine) into the
// paged cache [2, num_blocks, block_size, kv_heads, D] at slot_mapping (negative: skip): copied
// rows, or into an fp8 cache, saturated and rounded.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache [2, blocks, block_size, kv_heads, D] expected");
  const auto cache_type = kv_cache.scalar_type(), row_type = key.scalar_type();
  const bool to_fp8 = (cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2) &&
                      (row_type == at::kFloat || row_type == at::kHalf || row_type == at::kBFloat16);
  TORCH_CHECK(value.scalar_type() == row_type && (row_type == cache_type || to_fp8),
              "key/value dtype must be the cache's (or float, half or bfloat16 into an fp8 cache)");
  const int64_t T = key.size(0), row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(key.numel() == T * row && value.numel() == T * row && slot_mapping.numel() == T,
              "key/value rows do not match the cache's kv_heads x head_dim");
  auto rows_of = [&](const torch::Tensor& x) {  // each token's kv_heads x D elements contiguous
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  auto k = rows_of(key), v = rows_of(value);
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " outside the cache's ", num_slots);
  if (to_fp8) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, row_type, "store_kv_fp8", [&] {
      dispatch_cache<scalar_t>(kv_cache, [&](auto cache_elem) {
        using cache_t = decltype(cache_elem);
        cache_t* kc = kv_cache.data_ptr<cache_t>();
        cache_t* vc = kc + num_slots * row;
        const scalar_t* kp = k.data_ptr<scalar_t>();
        const scalar_t* vp = v.data_ptr<scalar_t>();
        for (int64_t t = 0; t < T; ++t) {
          if (s[t] < 0) continue;
          narrow_row(kp + t * k.stride(0), kc + s[t] * row, row);
          narrow_row(vp + t * v.stride(0), vc + s[t] * row, row);
        }
      });
    });
    return;
  }
  const int64_t elem = kv_cache.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + num_slots * row * elem;
  const int64_t ks = k.stride(0) * elem, vs = v.stride(0) * elem, nbytes = row * elem;
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    std::memcpy(kc + s[t] * nbytes, kp + t * ks, nbytes);
    std::memcpy(vc + s[t] * nbytes, vp + t * vs, nbytes);
  }
}

// Block movement for KV transfer: staging [layers, 2, n, block_size, kv_heads, D] <-> blocks
// block_ids[j] of each layer's cache [2, num_blocks, ...]; one memcpy per (layer, K/V, block).
// (torch's indexed writes of whole blocks run at about 1 GB/s on CPU.)
void copy_blocks(std::vector<torch::Tensor> kv_caches, torch::Tensor staging, torch::Tensor block_ids, bool to_staging) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(staging.is_contiguous() && staging.dim() == 6 && staging.size(0) == L && staging.size(1) == 2,
              "staging [layers, 2, n, block_size, kv_heads, head_dim] expected");
  auto ids = block_ids.to(torch::kLong).contiguous();
  const int64_t n = ids.numel();
  TORCH_CHECK(staging.size(2) == n, "staging holds ", staging.size(2), " blocks, ", n, " ids given");
  if (L == 0 || n == 0) return;
  const int64_t nb = kv_caches[0].size(1), elem = staging.element_size();
  const int64_t block_bytes = staging[0][0][0].numel() * elem;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(id[j] >= 0 && id[j] < nb, "block id ", id[j], " outside [0, ", nb, ")");
  std::vector<char*> layers(L);
  for (int64_t l = 0; l < L; ++l) {
    const auto& c = kv_caches[l];
    TORCH_CHECK(c.is_contiguous() && c.size(1) == nb && c.scalar_type() == staging.scalar_type() &&
                c[0][0].numel() * elem == block_bytes, "cache ", l, " does not match the staging layout");
    layers[l] = static_cast<char*>(c.data_ptr());
  }
  char* st = static_cast<char*>(staging.data_ptr());
  at::parallel_for(0, L * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t lk = begin; lk < end; ++lk) {
      char* cache = layers[lk / 2] + (lk % 2) * nb * block_bytes;
      char* stage = st + lk * n * block_bytes;
      for (int64_t j = 0; j < n; ++j) {
        char* blk = cache + id[j] * block_bytes;
        if (to_staging) std::memcpy(stage + j * block_bytes, blk, block_bytes);
        else std::memcpy(blk, stage + j * block_bytes, block_bytes);
      }
    }
  });
}

// RMSNorm over the last dim, with the residual add fused: (weight * norm(x + residual), x + residual),
// rounding where kernels.reference rounds (the sum, the normalised value, the product).
namespace {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* __restrict__ xp, const scalar_t* __restrict__ rp, const scalar_t* __restrict__ wp,
                   scalar_t* __restrict__ op, scalar_t* __restrict__ sp, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> h(D);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * D;
      if (rp != nullptr) {
        const scalar_t* rr = rp + r * D;
        scalar_t* sr = sp + r * D;
        for (int64_t d = 0; d < D; ++d) {
          const scalar_t v = static_cast<scalar_t>(to_f(xr[d]) + to_f(rr[d]));
          sr[d] = v;
          h[d] = to_f(v);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) h[d] = to_f(xr[d]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) ss += h[d] * h[d];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      scalar_t* o = op + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const scalar_t normed = static_cast<scalar_t>(h[d] * inv);
        o[d] = static_cast<scalar_t>(to_f(wp[d]) * to_f(normed));
      }
    }
  });
}

}  // namespace

std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == x.scalar_type(), "weight [D] of x's dtype expected");
  auto xc = x.contiguous();
  auto w = weight.contiguous();
  const bool add = residual.has_value();
  if (add) TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual must match x");
  auto rc = add ? residual->contiguous() : xc;
  auto res_out = add ? torch::empty_like(xc) : xc;
  auto out = torch::empty_like(xc);
  const int64_t rows = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(xc.data_ptr<scalar_t>(), add ? rc.data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), res_out.data_ptr<scalar_t>(), rows, D, static_cast<float>(eps));
  });
  return {out.view(x.sizes()), res_out.view(x.sizes())};
}

// A mixture of experts' MLP for one step, experts in parallel: the (token, expert) pairs come
// sorted by expert (`tokens`, `weights` in that order, `counts` per expert). The experts hit are
// dealt to the threads busiest first, round robin; a thread runs each of its experts' rows as two
// single-threaded matmuls (gate-up, SiLU-and-multiply, down scaled by the routing weight) into the
// pairs' own rows of one buffer; the pairs are then added to their tokens in order, expert by
// expert: kernels.reference.fused_moe's additions in its order (its matmuls within float rounding:
// single-threaded here). Parallel over experts rather than within each small matmul: a decode
// step's experts see a few rows each, where a matmul's own threading costs more than it computes.
// The caller (kernels/moe.py) runs it without autograd: the pool's threads run in inference mode.
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor tokens,
                        torch::Tensor weights, std::vector<int64_t> counts) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t experts = w13.size(0), inter = w13.size(1) / 2, hidden = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts, "fused_moe: one count per expert");
  std::vector<int64_t> start(experts + 1, 0), hit;
  for (int64_t e = 0; e < experts; ++e) {
    start[e + 1] = start[e] + counts[e];
    if (counts[e] > 0) hit.push_back(e);
  }
  TORCH_CHECK(start[experts] == tokens.numel() && tokens.numel() == weights.numel(), "fused_moe: counts and pairs");
  std::stable_sort(hit.begin(), hit.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  auto rows = x.index_select(0, tokens);
  auto down = at::empty({tokens.numel(), hidden}, x.options());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), hit.size()));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // The caller's inference mode is thread-local: without it here the pool's other threads would
    // record autograd history for the weights (parameters) and refuse the caller's inference tensors.
    c10::InferenceMode inference;
    for (int64_t w = begin; w < end; ++w) {
      for (size_t i = w; i < hit.size(); i += workers) {
        const int64_t e = hit[i], n = counts[e];
        auto gate_up = at::mm(rows.narrow(0, start[e], n), w13[e].t());
        auto h = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
        auto out = down.narrow(0, start[e], n);
        at::mm_out(out, h, w2[e].t());
        out.mul_(weights.narrow(0, start[e], n).unsqueeze(1));
      }
    }
  });
  return at::zeros_like(x).index_add_(0, tokens, down);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("query"),
        py::arg("kv_cache"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("out"),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU)",
        py::arg("query"), py::arg("kv_cache"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("block_tables"), py::arg("scale"), py::arg("out"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding, Neox style or interleaved (CPU)",
        py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"), py::arg("interleaved") = false);
  m.def("store_kv", &store_kv, "write K/V rows into the paged cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with a fused residual add (CPU)");
  m.def("copy_blocks", &copy_blocks, "KV blocks between the caches and a staging buffer (CPU)");
  m.def("fused_moe", &fused_moe, "a mixture of experts' MLP, experts in parallel (CPU)");
}

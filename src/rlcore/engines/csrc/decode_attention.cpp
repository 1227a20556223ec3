// Decode attention on the CPU for the embedded engine (rlcore.engines.decode_attention builds it).
//
// One query position per row attends to the row's cached keys and values, in fp32. The work is
// reading the cache: at 512 answer tokens it is hundreds of MB per decode step, and torch's SDPA
// reads it at about half the speed this machine streams memory. This kernel reads every key and
// value once, in address order:
//   - keys are stored in blocks of kBlock positions, kb[block][dim][kBlock], so a block's scores
//     are kBlock-wide multiply-adds over one contiguous 4 KiB (head dim 64), with no horizontal sums;
//   - values keep their usual layout, v[position][dim], so the weighted sum runs along each row;
//   - the query heads that share a key/value head (grouped-query attention) reuse the same block
//     while it is in L1.
// Softmax takes the row maximum first, so exp only sees arguments <= 0 (Cephes' polynomial, about
// 1 ulp; positions below exp(-87) count as 0, as do masked ones).
//
// Vectors are GCC/Clang vector extensions; on x86-64 GCC builds AVX-512, AVX2 and baseline clones
// of the inner loop and picks one at load time by the CPU it runs on.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RLCORE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RLCORE_CLONES
#endif
#define RLCORE_INLINE inline __attribute__((always_inline))

namespace {

constexpr int64_t kBlock = 16;  // positions per key block = lanes per vector
typedef float vf __attribute__((vector_size(kBlock * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kBlock * sizeof(int32_t))));

RLCORE_INLINE vf load(const float* p) {
  vf x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

RLCORE_INLINE void store(float* p, vf x) { __builtin_memcpy(p, &x, sizeof(x)); }

// exp(x) for x <= 0; 0 below -87 (so -inf, a masked position, gives 0).
RLCORE_INLINE vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  const vf c = x < lo ? lo : x;
  const vi n_int = __builtin_convertvector(c * 1.44269504088896341f - 0.5f, vi);
  const vf n = __builtin_convertvector(n_int, vf);
  vf r = c - n * 0.693359375f;  // c - n ln 2, in two parts
  r = r - n * -2.12194440e-4f;
  const vf z = r * r;
  vf y = vf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const vf two_n = (vf)((n_int + 127) << 23);
  return x < lo ? vf{} : y * two_n;
}

struct Head {
  const float* q;        // [groups][q_head_stride]: the query heads of this key/value head
  int64_t q_head_stride;
  const float* keys;     // [blocks][dim][kBlock]
  const float* values;   // [length][v_pos_stride]
  int64_t v_pos_stride;
  const bool* mask;      // [length] at mask_stride, or null (attend to all)
  int64_t mask_stride;
  float* out;            // [groups][dim], contiguous
};

// kDim > 0: the head dim, known at compile time (the value accumulators stay in registers);
// 0: any head dim, read from `dim`.
template <int64_t kDim>
RLCORE_INLINE void attend_impl(const Head& h, int64_t groups, int64_t length, int64_t dim_arg,
                               float scale, float* __restrict__ scores, int64_t padded) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  // Scores, one block of positions at a time: scores[g][l] = scale * q_g . k_l.
  for (int64_t l = 0; l < padded; l += kBlock) {
    const float* __restrict__ block = h.keys + l * dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict__ qg = h.q + g * h.q_head_stride;
      vf even = {}, odd = {};  // two chains, so consecutive multiply-adds do not wait on each other
      int64_t d = 0;
      for (; d + 2 <= dim; d += 2) {
        even += qg[d] * load(block + d * kBlock);
        odd += qg[d + 1] * load(block + (d + 1) * kBlock);
      }
      if (d < dim) even += qg[d] * load(block + d * kBlock);
      store(scores + g * padded + l, (even + odd) * scale);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* __restrict__ s = scores + g * padded;
    if (h.mask != nullptr) {
      for (int64_t l = 0; l < length; ++l) s[l] = h.mask[l * h.mask_stride] ? s[l] : -INFINITY;
    }
    // The last block's positions past `length` hold whatever the cache buffer held.
    for (int64_t l = length; l < padded; ++l) s[l] = -INFINITY;
    vf top = vf{} - INFINITY;
    for (int64_t l = 0; l < padded; l += kBlock) {
      const vf x = load(s + l);
      top = x > top ? x : top;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < kBlock; ++j) m = top[j] > m ? top[j] : m;
    vf sums = {};
    for (int64_t l = 0; l < padded; l += kBlock) {
      const vf p = exp_nonpositive(load(s + l) - m);
      store(s + l, p);
      sums += p;
    }
    float total = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) total += sums[j];
    const float inv = 1.0f / total;
    float* __restrict__ o = h.out + g * dim;
    if constexpr (kDim > 0) {
      vf acc[kDim / kBlock] = {};
      for (int64_t l = 0; l < length; ++l) {
        const float p = s[l];
        const float* __restrict__ v = h.values + l * h.v_pos_stride;
        for (int64_t j = 0; j < kDim / kBlock; ++j) acc[j] += p * load(v + j * kBlock);
      }
      for (int64_t j = 0; j < kDim / kBlock; ++j) store(o + j * kBlock, acc[j] * inv);
    } else {
      for (int64_t e = 0; e < dim; ++e) o[e] = 0.f;
      for (int64_t l = 0; l < length; ++l) {
        const float p = s[l];
        const float* __restrict__ v = h.values + l * h.v_pos_stride;
        for (int64_t e = 0; e < dim; ++e) o[e] += p * v[e];
      }
      for (int64_t e = 0; e < dim; ++e) o[e] *= inv;
    }
  }
}

RLCORE_CLONES
void attend(const Head& h, int64_t groups, int64_t length, int64_t dim, float scale,
            float* scores, int64_t padded) {
  switch (dim) {
    case 64:
      return attend_impl<64>(h, groups, length, dim, scale, scores, padded);
    case 128:
      return attend_impl<128>(h, groups, length, dim, scale, scores, padded);
    default:
      return attend_impl<0>(h, groups, length, dim, scale, scores, padded);
  }
}

// q: [B, H, 1, D]; keys: [B, KVH, blocks, D, kBlock] (blocks * kBlock >= L, the last three dims
// contiguous); values: [B, KVH, L, D]; mask: [B, L] bool (true = attend) or None. Query head h
// reads key/value head h / (H / KVH). Returns [B, 1, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.stride(3) == 1,
              "decode_attention: q must be [B, H, 1, D] with D contiguous, got ", q.sizes());
  TORCH_CHECK(values.dim() == 4 && values.stride(3) == 1,
              "decode_attention: values must be [B, KVH, L, D] with D contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t KVH = values.size(1), L = values.size(2);
  TORCH_CHECK(values.size(0) == B && values.size(3) == D && L >= 1 && KVH >= 1 && H % KVH == 0,
              "decode_attention: values ", values.sizes(), " do not match q ", q.sizes());
  TORCH_CHECK(keys.dim() == 5 && keys.size(0) == B && keys.size(1) == KVH &&
                  keys.size(2) * kBlock >= L && keys.size(3) == D && keys.size(4) == kBlock &&
                  keys.stride(4) == 1 && keys.stride(3) == kBlock && keys.stride(2) == D * kBlock,
              "decode_attention: keys must be [B, KVH, blocks, D, ", kBlock,
              "] holding L positions, got ", keys.sizes());
  const bool* mask_data = nullptr;
  int64_t mask_row = 0, mask_pos = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == B &&
                    mask->size(1) == L,
                "decode_attention: mask must be [B, L] bool, got ", mask->sizes());
    mask_data = mask->data_ptr<bool>();
    mask_row = mask->stride(0);
    mask_pos = mask->stride(1);
  }
  const int64_t groups = H / KVH;
  const int64_t padded = (L + kBlock - 1) / kBlock * kBlock;
  at::Tensor out = at::empty({B, 1, H, D}, q.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * padded);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, kv = i % KVH;
      const Head h{q_data + b * q.stride(0) + kv * groups * q.stride(1),
                   q.stride(1),
                   k_data + b * keys.stride(0) + kv * keys.stride(1),
                   v_data + b * values.stride(0) + kv * values.stride(1),
                   values.stride(2),
                   mask_data == nullptr ? nullptr : mask_data + b * mask_row,
                   mask_pos,
                   out_data + (b * H + kv * groups) * D};
      attend(h, groups, L, D, s, scores.data(), padded);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(rlcore, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlcore, CPU, m) { m.impl("decode_attention", &decode_attention); }

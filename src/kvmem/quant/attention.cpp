// Decode-step attention that reads KIVI-style codes in place (kvmem.quant.kernel): no decoded copy of the cache.
//
// One query token per query head attends every row its KV head holds: the encoded rows (keys quantized per channel in
// groups of `group_k` rows, values per row in groups of `group_v` channels; `bits`-bit codes packed 8 per `bits` bytes,
// kvmem.quant.pack) and then the full-precision residual rows. Per block of key rows the key scales are folded into
// the query (q * scale, and q . zero as a bias), so a key row costs one unpack and a dot product per query head; a
// value row adds p * (code * scale + zero) to the output. The bytes read are the codes themselves: 4-bit rows are an
// eighth of float32 ones.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// float16 scales and zero-points: the hardware conversion where there is one (c10::Half's is a bit-twiddling routine)
inline float f32(at::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// A row's codes as float "planes": with P = 8 / bits codes per byte (1, 2, 4 or 8 bits), plane k holds the code at
// shift k * bits of every byte, i.e. channel b * P + k at index k * w + b (w = d / P), so unpacking and the dot
// products run over contiguous arrays (vectorized); 3-bit codes (spanning bytes) unpack in channel order (P = 1).
inline int64_t planes(int64_t bits) { return 8 % bits == 0 ? 8 / bits : 1; }

// P and w = d / P come in precomputed: integer divisions per row would cost more than the unpacking itself.
inline void unpack_planes(const uint8_t* p, int64_t bits, int64_t P, int64_t w, float* out) {
  if (P > 1 || bits == 8) {
    const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1);
    for (int64_t k = 0; k < P; ++k) {
      const int shift = static_cast<int>(k * bits);
      float* o = out + k * w;
#pragma omp simd
      for (int64_t b = 0; b < w; ++b) o[b] = static_cast<float>((p[b] >> shift) & mask);
    }
    return;
  }
  const uint32_t mask = (1u << bits) - 1;  // 8 codes in `bits` bytes, little-endian
  for (int64_t blk = 0; blk < w / 8; ++blk) {
    uint32_t word = 0;
    for (int64_t i = 0; i < bits; ++i) word |= uint32_t(p[blk * bits + i]) << (8 * i);
    for (int64_t i = 0; i < 8; ++i) out[blk * 8 + i] = static_cast<float>((word >> (i * bits)) & mask);
  }
}

// The index of channel c in the planar order.
inline int64_t planar(int64_t c, int64_t P, int64_t w) { return (c % P) * w + c / P; }

// A dot product whose horizontal sum stays in registers (GCC's `omp simd reduction` spills the lanes to the stack and
// adds them one by one: the kernel's hottest loop; keeping it in registers took 3 x 1k rows from 324 to 268 us).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// q (Hq, D) float32; kp (N, D*kbits/8) uint8, ks/kz (D, N/group_k) half; vp (N, D*vbits/8) uint8, vs/vz (N, D/group_v)
// half; off (H+1) int64: KV head h's encoded rows are [off[h], off[h+1]) (multiples of group_k); rk/rv (R, D) float32,
// roff (H+1) int64 likewise. Returns (Hq, D) float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kp, torch::Tensor ks, torch::Tensor kz, int64_t kbits,
                               int64_t group_k, torch::Tensor vp, torch::Tensor vs, torch::Tensor vz, int64_t vbits,
                               int64_t group_v, torch::Tensor off, torch::Tensor rk, torch::Tensor rv, torch::Tensor roff,
                               double scaling) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && rk.scalar_type() == torch::kFloat && rv.scalar_type() == torch::kFloat);
  TORCH_CHECK(kp.scalar_type() == torch::kByte && vp.scalar_type() == torch::kByte);
  TORCH_CHECK(ks.scalar_type() == torch::kHalf && vs.scalar_type() == torch::kHalf);
  q = q.contiguous(); kp = kp.contiguous(); vp = vp.contiguous(); ks = ks.contiguous(); kz = kz.contiguous();
  vs = vs.contiguous(); vz = vz.contiguous(); rk = rk.contiguous(); rv = rv.contiguous();
  off = off.contiguous(); roff = roff.contiguous();
  const int64_t hq = q.size(0), d = q.size(1), heads = off.size(0) - 1, groups = hq / heads;
  const int64_t kstride = kp.size(1), vstride = vp.size(1), kcols = ks.size(1), vcols = vs.size(1);
  const int64_t KP = planes(kbits), kw = d / KP, VP = planes(vbits), vw = d / VP;
  TORCH_CHECK(d % 8 == 0 && hq % heads == 0 && group_v % VP == 0 && d % group_v == 0);
  auto out = torch::empty({hq, d}, q.options());
  const float* qd = q.data_ptr<float>();
  const uint8_t* kpd = kp.data_ptr<uint8_t>();
  const uint8_t* vpd = vp.data_ptr<uint8_t>();
  const at::Half* ksd = ks.data_ptr<at::Half>();
  const at::Half* kzd = kz.data_ptr<at::Half>();
  const at::Half* vsd = vs.data_ptr<at::Half>();
  const at::Half* vzd = vz.data_ptr<at::Half>();
  const float* rkd = rk.data_ptr<float>();
  const float* rvd = rv.data_ptr<float>();
  const int64_t* offd = off.data_ptr<int64_t>();
  const int64_t* roffd = roff.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);

  std::vector<int64_t> kperm(d), vperm(d);
  for (int64_t c = 0; c < d; ++c) kperm[c] = planar(c, KP, kw), vperm[c] = planar(c, VP, vw);
  const int64_t span = group_v / VP, vgroups = d / group_v;  // a channel group's codes in one plane

  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> codes(d), qs(groups * d), bias(groups), acc(groups * d);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t e0 = offd[h], e1 = offd[h + 1], r0 = roffd[h], r1 = roffd[h + 1];
      const int64_t ne = e1 - e0, n = ne + (r1 - r0);
      std::vector<float> p(groups * n);
      const float* qh = qd + h * groups * d;
      // scores of the encoded rows: per block of group_k rows, the block's key scales folded into the queries (planar)
      for (int64_t b0 = e0; b0 < e1; b0 += group_k) {
        const int64_t col = b0 / group_k;
        for (int64_t j = 0; j < groups; ++j) {
          float z = 0.f;
          for (int64_t c = 0; c < d; ++c) {
            const float qc = qh[j * d + c];
            qs[j * d + kperm[c]] = qc * f32(ksd[c * kcols + col]);
            z += qc * f32(kzd[c * kcols + col]);
          }
          bias[j] = z;
        }
        for (int64_t t = b0; t < std::min(b0 + group_k, e1); ++t) {
          unpack_planes(kpd + t * kstride, kbits, KP, kw, codes.data());
          for (int64_t j = 0; j < groups; ++j) p[j * n + (t - e0)] = (bias[j] + dot(qs.data() + j * d, codes.data(), d)) * scale;
        }
      }
      for (int64_t r = r0; r < r1; ++r)  // the residual rows, full precision
        for (int64_t j = 0; j < groups; ++j) p[j * n + ne + (r - r0)] = dot(qh + j * d, rkd + r * d, d) * scale;
      std::vector<float> total(groups);
      for (int64_t j = 0; j < groups; ++j) {  // softmax per query head (normalized at the end)
        float* pj = p.data() + j * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, pj[t]);
        float s = 0.f;
        for (int64_t t = 0; t < n; ++t) s += (pj[t] = std::exp(pj[t] - m));
        total[j] = s;
      }
      std::fill(acc.begin(), acc.end(), 0.f);  // values of the encoded rows, accumulated in planar order
      for (int64_t t = e0; t < e1; ++t) {
        unpack_planes(vpd + t * vstride, vbits, VP, vw, codes.data());
        for (int64_t j = 0; j < groups; ++j) {
          const float pt = p[j * n + (t - e0)];
          float* a = acc.data() + j * d;
          for (int64_t g = 0; g < vgroups; ++g) {
            const float sc = pt * f32(vsd[t * vcols + g]);
            const float zr = pt * f32(vzd[t * vcols + g]);
            for (int64_t k = 0; k < VP; ++k) {
              float* ak = a + k * vw + g * span;
              const float* ck = codes.data() + k * vw + g * span;
#pragma omp simd
              for (int64_t b = 0; b < span; ++b) ak[b] += sc * ck[b] + zr;
            }
          }
        }
      }
      float* oh = od + h * groups * d;
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t c = 0; c < d; ++c) oh[j * d + c] = acc[j * d + vperm[c]];
      for (int64_t r = r0; r < r1; ++r) {
        const float* vr = rvd + r * d;
        for (int64_t j = 0; j < groups; ++j) {
          const float pt = p[j * n + ne + (r - r0)];
          float* o = oh + j * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) o[c] += pt * vr[c];
        }
      }
      for (int64_t j = 0; j < groups; ++j) {
        const float inv = 1.f / total[j];
        for (int64_t c = 0; c < d; ++c) oh[j * d + c] *= inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode-step attention over packed KIVI codes and a residual");
}

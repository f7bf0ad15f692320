// Decode-step attention of a batch of sequences (kvmem.kernel): KIVI-style codes read in place (no decoded copy of the
// cache) and full-precision rows, every sequence and KV head in one call.
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


// One KV head of one sequence: its query heads and output, its encoded rows [e0, e1) in the sequence's joined codes, and
// its residual rows.
struct Head {
  const float* q;  // (groups, d)
  float* out;      // (groups, d)
  const uint8_t* kp; const at::Half* ks; const at::Half* kz; int64_t kcols;  // ks, kz: (d, kcols)
  const uint8_t* vp; const at::Half* vs; const at::Half* vz;                 // vs, vz: (rows, d / group_v)
  int64_t e0, e1;
  const float* rk; const float* rv; int64_t r;                               // (r, d) each
};

struct Layout {
  int64_t d, groups, kbits, group_k, vbits, group_v, kstride, vstride, vcols, KP, kw, VP, vw, span, vgroups;
  std::vector<int64_t> kperm, vperm;
  float scale;
};

// The values of the encoded rows, p * (code * scale + zero) summed over rows into acc (groups, d) in planar order, with
// every query head's accumulator in registers: 16 planar lanes at a time (one plane's bytes, all of one value group),
// row by row, codes converted straight from their bytes; the zero-points' share, sum_t p * zero per group, apart.
// Where a chunk of 16 lanes would span two value groups (or 3-bit codes, or more than 4 query heads per KV head), or
// without AVX-512, false: the generic loop serves.
template <int G>
void values_chunked(const Head& x, const Layout& L, const float* p, int64_t n, float* acc) {
#if defined(__AVX512F__)
  const int64_t ne = x.e1 - x.e0, chunks = L.d / 16;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t plane = (c * 16) / L.vw, b0 = (c * 16) % L.vw, g = b0 / L.span;
    const int shift = static_cast<int>(plane * L.vbits);
    __m512 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm512_setzero_ps();
    const uint8_t* row = x.vp + x.e0 * L.vstride + b0;
    const at::Half* sc = x.vs + x.e0 * L.vcols + g;
    for (int64_t t = 0; t < ne; ++t, row += L.vstride, sc += L.vcols) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
      if (L.vbits == 4) bytes = _mm_and_si128(_mm_srli_epi16(bytes, shift), low);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), _mm512_set1_ps(f32(*sc)));
      for (int j = 0; j < G; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * n + t]), v, a[j]);
    }
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc + j * L.d + c * 16, a[j]);
  }
  // the zero-points: every channel of value group g gets sum_t p * zero[t, g]
  std::vector<float> zsum(G * L.vgroups, 0.f);
  for (int64_t t = 0; t < ne; ++t)
    for (int64_t g = 0; g < L.vgroups; ++g) {
      const float z = f32(x.vz[(x.e0 + t) * L.vcols + g]);
      for (int j = 0; j < G; ++j) zsum[j * L.vgroups + g] += p[j * n + t] * z;
    }
  for (int j = 0; j < G; ++j)
    for (int64_t i = 0; i < L.d; ++i) acc[j * L.d + i] += zsum[j * L.vgroups + (i % L.vw) / L.span];
#endif
}

bool values_in_registers(const Head& x, const Layout& L, const float* p, int64_t n, float* acc) {
#if defined(__AVX512F__)
  if ((L.vbits != 8 && L.vbits != 4) || L.span % 16 || L.vw % 16) return false;
  switch (L.groups) {
    case 1: values_chunked<1>(x, L, p, n, acc); return true;
    case 2: values_chunked<2>(x, L, p, n, acc); return true;
    case 3: values_chunked<3>(x, L, p, n, acc); return true;
    case 4: values_chunked<4>(x, L, p, n, acc); return true;
  }
#endif
  return false;
}

// The scores of encoded key rows [t0, t1) (one block: one scale and zero-point per channel, folded into qs and bias) with
// every query head's dot product in registers: a row's codes are converted straight from their bytes, 16 planar lanes
// at a time, and multiplied into G accumulators (the generic path unpacks each row into a buffer, then reads it back
// once per query head). Needs AVX-512, 8/4/2-bit codes and planes of whole 16-byte chunks; else false.
template <int G>
void keys_chunked(const Head& x, const Layout& L, const float* qs, const float* bias, int64_t t0, int64_t t1, float* p,
                  int64_t n) {
#if defined(__AVX512F__)
  constexpr int C = 8;  // up to 8 chunks of 16 lanes: head_dim <= 128
  const int64_t chunks = L.d / 16;
  const __m128i mask = _mm_set1_epi8(static_cast<char>((1u << L.kbits) - 1));
  __m512 q[G][C];
  int64_t offset[C];
  int shift[C];
  for (int64_t c = 0; c < chunks; ++c) {
    offset[c] = (c * 16) % L.kw;
    shift[c] = static_cast<int>((c * 16) / L.kw * L.kbits);
    for (int j = 0; j < G; ++j) q[j][c] = _mm512_loadu_ps(qs + j * L.d + c * 16);
  }
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* row = x.kp + t * L.kstride;
    __m512 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + offset[c]));
      if (L.kbits != 8) bytes = _mm_and_si128(_mm_srli_epi16(bytes, shift[c]), mask);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      for (int j = 0; j < G; ++j) a[j] = _mm512_fmadd_ps(q[j][c], v, a[j]);
    }
    for (int j = 0; j < G; ++j) p[j * n + (t - x.e0)] = (bias[j] + _mm512_reduce_add_ps(a[j])) * L.scale;
  }
#endif
}

bool keys_in_registers(const Head& x, const Layout& L, const float* qs, const float* bias, int64_t t0, int64_t t1,
                       float* p, int64_t n) {
#if defined(__AVX512F__)
  if ((L.kbits != 8 && L.kbits != 4 && L.kbits != 2) || L.kw % 16 || L.d > 128) return false;
  switch (L.groups) {
    case 1: keys_chunked<1>(x, L, qs, bias, t0, t1, p, n); return true;
    case 2: keys_chunked<2>(x, L, qs, bias, t0, t1, p, n); return true;
    case 3: keys_chunked<3>(x, L, qs, bias, t0, t1, p, n); return true;
    case 4: keys_chunked<4>(x, L, qs, bias, t0, t1, p, n); return true;
  }
#endif
  return false;
}

#if defined(__AVX512F__)
// exp of 16 floats <= 0 (scores minus their maximum): Cephes' expf, a degree-5 polynomial on x - n ln 2 scaled by
// 2^n; within 2 ulp of std::exp, which the compiler leaves scalar here (a softmax over 4k rows spent most of its time
// in it).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}
#endif

// p[t] = exp(p[t] - max p) in place; returns their sum (the softmax's denominator).
inline float softmax_unnormalized(float* p, int64_t n) {
  int64_t t = 0;
  float m = -std::numeric_limits<float>::infinity(), s = 0.f;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + t));
  m = _mm512_reduce_max_ps(mv);
  for (int64_t i = t; i < n; ++i) m = std::max(m, p[i]);
  __m512 sv = _mm512_setzero_ps();
  const __m512 mb = _mm512_set1_ps(m);
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t), mb));
    _mm512_storeu_ps(p + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  s = _mm512_reduce_add_ps(sv);
#else
  for (; t < n; ++t) m = std::max(m, p[t]);
  t = 0;
#endif
  for (; t < n; ++t) s += (p[t] = std::exp(p[t] - m));
  return s;
}

void attend(const Head& x, const Layout& L, std::vector<float>& codes, std::vector<float>& qs, std::vector<float>& bias,
            std::vector<float>& acc, std::vector<float>& p) {
  const int64_t d = L.d, groups = L.groups, ne = x.e1 - x.e0, n = ne + x.r;
  p.resize(groups * n);
  // scores of the encoded rows: per block of group_k rows, the block's key scales folded into the queries (planar):
  // the block's scales and zero-points converted once, then every query head scaled in one vector pass (converting
  // them per query head, channel by channel, took a quarter of the kernel)
  float* qp = codes.data() + d;  // the queries in planar order
  float* sc = qp + groups * d;   // the block's key scales, then zero-points, planar
  if (x.e1 > x.e0)
    for (int64_t j = 0; j < groups; ++j)
      for (int64_t c = 0; c < d; ++c) qp[j * d + L.kperm[c]] = x.q[j * d + c];
  for (int64_t b0 = x.e0; b0 < x.e1; b0 += L.group_k) {
    const int64_t col = b0 / L.group_k;
    for (int64_t c = 0; c < d; ++c) {
      sc[L.kperm[c]] = f32(x.ks[c * x.kcols + col]);
      sc[d + L.kperm[c]] = f32(x.kz[c * x.kcols + col]);
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* qsj = qs.data() + j * d;
      const float* qpj = qp + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) qsj[i] = qpj[i] * sc[i];
      bias[j] = dot(qpj, sc + d, d);
    }
    const int64_t t1 = std::min(b0 + L.group_k, x.e1);
    if (keys_in_registers(x, L, qs.data(), bias.data(), b0, t1, p.data(), n)) continue;
    for (int64_t t = b0; t < t1; ++t) {
      unpack_planes(x.kp + t * L.kstride, L.kbits, L.KP, L.kw, codes.data());
      for (int64_t j = 0; j < groups; ++j)
        p[j * n + (t - x.e0)] = (bias[j] + dot(qs.data() + j * d, codes.data(), d)) * L.scale;
    }
  }
  for (int64_t r = 0; r < x.r; ++r)  // the residual rows, full precision
    for (int64_t j = 0; j < groups; ++j) p[j * n + ne + r] = dot(x.q + j * d, x.rk + r * d, d) * L.scale;
  std::vector<float> total(groups);
  for (int64_t j = 0; j < groups; ++j) total[j] = softmax_unnormalized(p.data() + j * n, n);  // normalized at the end
  std::fill(acc.begin(), acc.end(), 0.f);  // values of the encoded rows, accumulated in planar order
  const bool done = x.e1 > x.e0 && values_in_registers(x, L, p.data(), n, acc.data());
  for (int64_t t = done ? x.e1 : x.e0; t < x.e1; ++t) {  // the generic loop, where the registers' one does not apply
    unpack_planes(x.vp + t * L.vstride, L.vbits, L.VP, L.vw, codes.data());
    for (int64_t j = 0; j < groups; ++j) {
      const float pt = p[j * n + (t - x.e0)];
      float* a = acc.data() + j * d;
      for (int64_t g = 0; g < L.vgroups; ++g) {
        const float sc = pt * f32(x.vs[t * L.vcols + g]);
        const float zr = pt * f32(x.vz[t * L.vcols + g]);
        for (int64_t k = 0; k < L.VP; ++k) {
          float* ak = a + k * L.vw + g * L.span;
          const float* ck = codes.data() + k * L.vw + g * L.span;
#pragma omp simd
          for (int64_t b = 0; b < L.span; ++b) ak[b] += sc * ck[b] + zr;
        }
      }
    }
  }
  for (int64_t j = 0; j < groups; ++j)
    for (int64_t c = 0; c < d; ++c) x.out[j * d + c] = acc[j * d + L.vperm[c]];
  for (int64_t r = 0; r < x.r; ++r) {
    const float* vr = x.rv + r * d;
    for (int64_t j = 0; j < groups; ++j) {
      const float pt = p[j * n + ne + r];
      float* o = x.out + j * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) o[c] += pt * vr[c];
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    const float inv = 1.f / total[j];
    for (int64_t c = 0; c < d; ++c) x.out[j * d + c] *= inv;
  }
}

}  // namespace

// B sequences' decode step in one call, parallel over (sequence, KV head). q (B, Hq, D) float32. Per sequence b, its
// KV heads' encoded rows joined along rows: kp[b] (N_b, D*kbits/8) uint8, ks/kz[b] (D, N_b/group_k) half, vp[b]
// (N_b, D*vbits/8) uint8, vs/vz[b] (N_b, D/group_v) half, off[b] (H+1) int64 (head h's rows are [off[h], off[h+1]),
// multiples of group_k), or every one of these lists empty (full-precision rows only); its full-precision rows per
// head: rk/rv[b * H + h] (R, D) float32, of which the first rn[b * H + h] rows are read. Returns (B, Hq, D) float32.
torch::Tensor decode_attention(torch::Tensor q, std::vector<torch::Tensor> kp, std::vector<torch::Tensor> ks,
                               std::vector<torch::Tensor> kz, int64_t kbits, int64_t group_k, std::vector<torch::Tensor> vp,
                               std::vector<torch::Tensor> vs, std::vector<torch::Tensor> vz, int64_t vbits, int64_t group_v,
                               std::vector<torch::Tensor> off, std::vector<torch::Tensor> rk, std::vector<torch::Tensor> rv,
                               std::vector<int64_t> rn, double scaling) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 3);
  q = q.contiguous();
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2);
  const bool coded = !kp.empty();
  TORCH_CHECK(B >= 1 && rk.size() == rv.size() && rn.size() == rk.size() && (int64_t)rk.size() % B == 0);
  TORCH_CHECK(!coded || ((int64_t)kp.size() == B && (int64_t)ks.size() == B && (int64_t)kz.size() == B &&
                         (int64_t)vp.size() == B && (int64_t)vs.size() == B && (int64_t)vz.size() == B &&
                         (int64_t)off.size() == B));
  const int64_t heads = (int64_t)rk.size() / B;
  TORCH_CHECK(heads >= 1 && hq % heads == 0);
  Layout L;
  L.d = d; L.groups = hq / heads; L.kbits = kbits; L.group_k = group_k; L.vbits = vbits; L.group_v = group_v;
  L.kstride = d * kbits / 8; L.vstride = d * vbits / 8; L.vcols = d / group_v;
  L.KP = planes(kbits); L.kw = d / L.KP; L.VP = planes(vbits); L.vw = d / L.VP;
  L.span = group_v / L.VP; L.vgroups = d / group_v; L.scale = static_cast<float>(scaling);
  TORCH_CHECK(d % 8 == 0 && group_v % L.VP == 0 && d % group_v == 0);
  L.kperm.resize(d); L.vperm.resize(d);
  for (int64_t c = 0; c < d; ++c) L.kperm[c] = planar(c, L.KP, L.kw), L.vperm[c] = planar(c, L.VP, L.vw);

  auto out = torch::empty({B, hq, d}, q.options());
  std::vector<torch::Tensor> held;  // contiguous copies where an input was not (kept alive for the call)
  auto ready = [&](torch::Tensor t, c10::ScalarType type) {
    TORCH_CHECK(t.scalar_type() == type, "decode_attention: a tensor of the wrong dtype");
    if (!t.is_contiguous()) held.push_back(t = t.contiguous());
    return t;
  };
  std::vector<Head> work;
  work.reserve(B * heads);
  for (int64_t b = 0; b < B; ++b) {
    Head head{};
    const int64_t* o = nullptr;
    if (coded) {
      auto kpb = ready(kp[b], torch::kByte), ksb = ready(ks[b], torch::kHalf), kzb = ready(kz[b], torch::kHalf);
      auto vpb = ready(vp[b], torch::kByte), vsb = ready(vs[b], torch::kHalf), vzb = ready(vz[b], torch::kHalf);
      auto offb = ready(off[b], torch::kLong);
      TORCH_CHECK(offb.numel() == heads + 1 && kpb.size(1) == L.kstride && vpb.size(1) == L.vstride && ksb.size(0) == d);
      o = offb.data_ptr<int64_t>();
      TORCH_CHECK(o[heads] <= kpb.size(0) && o[heads] <= vpb.size(0));
      head.kp = kpb.data_ptr<uint8_t>(); head.ks = ksb.data_ptr<at::Half>(); head.kz = kzb.data_ptr<at::Half>();
      head.kcols = ksb.size(1);
      head.vp = vpb.data_ptr<uint8_t>(); head.vs = vsb.data_ptr<at::Half>(); head.vz = vzb.data_ptr<at::Half>();
      held.insert(held.end(), {kpb, ksb, kzb, vpb, vsb, vzb, offb});
    }
    for (int64_t h = 0; h < heads; ++h) {
      auto rkh = ready(rk[b * heads + h], torch::kFloat), rvh = ready(rv[b * heads + h], torch::kFloat);
      const int64_t rows = rn[b * heads + h];
      TORCH_CHECK(rows >= 0 && rows <= rkh.size(0) && rows <= rvh.size(0) &&
                  (rows == 0 || (rkh.size(1) == d && rvh.size(1) == d)));
      if (coded) TORCH_CHECK(o[h] % group_k == 0 && o[h] <= o[h + 1]);
      head.q = q.data_ptr<float>() + (b * hq + h * L.groups) * d;
      head.out = out.data_ptr<float>() + (b * hq + h * L.groups) * d;
      head.e0 = coded ? o[h] : 0;
      head.e1 = coded ? o[h + 1] : 0;
      head.rk = rkh.data_ptr<float>(); head.rv = rvh.data_ptr<float>(); head.r = rows;
      work.push_back(head);
    }
  }
  at::parallel_for(0, (int64_t)work.size(), 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> codes(d + L.groups * d + 2 * d), qs(L.groups * d), bias(L.groups), acc(L.groups * d), p;
    for (int64_t w = w0; w < w1; ++w) attend(work[w], L, codes, qs, bias, acc, p);
  });
  return out;
}

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor w);  // linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "x (N, in) @ w (out, in)^T for a few rows (N <= 64), float32");
  m.def("decode_attention", &decode_attention,
        "decode-step attention of B sequences over their packed KIVI codes (if any) and full-precision rows");
}

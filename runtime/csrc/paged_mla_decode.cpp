// deepinfer_cpu::paged_mla_decode: absorbed multi-head latent attention for decode tokens, straight from the
// paged latent pool, fp32 math, x86-64 AVX2 + FMA.
//
//   q [T, H, Dc]            each token's absorbed query (W_UK folded into the nope part, then the rope part)
//   kv_cache [NB, bs, Dc]   the latent pool: per slot the normed c_kv (first kv_lora_rank) and the roped k_pe;
//                           fp32, or bf16 (--dtype bfloat16): a task widens its token's span of keys once
//   block_tables [T, B]     each token's pool blocks, in key order (key c lives in block c / bs, slot c % bs)
//   valid [T, B * bs]       which keys each token attends to (its own positions so far; with CP, those it owns)
//   -> o [T, H, kv_lora_rank] = softmax(scale * q . k) . c_kv over the valid keys (zero where none is),
//      lse [T, H]             the log-sum-exp of the scaled scores (-inf where no key is valid), for the
//                             context-parallel merge of partial attentions.
//
// The graph form gathers every token's context into a fresh [T, C, Dc] buffer and runs two batched GEMMs over it;
// here each token's keys are read where they lie, scored against all its heads at once, and the softmax-weighted
// latent sum is accumulated in place: no gather, no [T, H, C] round trip through memory. Tokens run in parallel
// on torch's thread pool. Built with grouped_rows_mm.cpp by runtime/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using deepinfer_simd::exp_nonpositive;
using deepinfer_simd::hsum8;
using deepinfer_simd::load_bf16;

// n bf16 values widened to fp32 (exact).
inline void widen_row(const at::BFloat16* src, int64_t n, float* dst) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16(p + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Scores of NH heads x NK keys (NH * NK = 8) in one pass over Dc: s[h * ldc + k] = q[h] . key[k] (unscaled).
template <int NH, int NK>
inline void score_tile(const float* q, const float* const* keys, int64_t Dc, float* s, int64_t ldc) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= Dc; d += 8) {
    __m256 kv[NK];
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) kv[k] = _mm256_loadu_ps(keys[k] + d);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * Dc + d);
#pragma GCC unroll 8
      for (int k = 0; k < NK; ++k) acc[h * NK + k] = _mm256_fmadd_ps(qv, kv[k], acc[h * NK + k]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, hsum8(acc));
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) {
      float v = r[h * NK + k];
      for (int64_t dd = d; dd < Dc; ++dd) v += q[h * Dc + dd] * keys[k][dd];
      s[h * ldc + k] = v;
    }
}

// Scores of all H heads for keys [c0, c1) -> s [H][C] (head-major), NH heads x 8/NH keys at a time.
template <int NH>
void score_keys(const float* q, const float* const* key_rows, int64_t c0, int64_t c1, int64_t H, int64_t Dc,
                float* s, int64_t C) {
  constexpr int NK = 8 / NH;
  const float* pad[NK];
  for (int64_t c = c0; c < c1; c += NK) {
    const float* const* keys = key_rows + c;
    if (c + NK > c1) {               // the last keys: repeat the final one, keep the real results only
      for (int k = 0; k < NK; ++k) pad[k] = key_rows[std::min(c + k, c1 - 1)];
      keys = pad;
    }
    alignas(32) float tmp[8 * NK];
    for (int64_t h = 0; h < H; h += NH) {
      score_tile<NH, NK>(q + h * Dc, keys, Dc, tmp, NK);
      for (int hh = 0; hh < NH; ++hh)
        for (int k = 0; k < NK && c + k < c1; ++k) s[(h + hh) * C + c + k] = tmp[hh * NK + k];
    }
  }
}

// o[h, d0 .. d0 + 16) for NH heads = sum over valid keys c of p[h][c] * v_c[d0 .. d0 + 16), in registers.
template <int NH>
inline void weighted_sum16(const float* p, int64_t C, const float* const* key_rows, const bool* valid, int64_t c0,
                           int64_t c1, int64_t d0, float* o, int64_t L) {
  __m256 acc[NH][2];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    if (!valid[c]) continue;
    const __m256 v0 = _mm256_loadu_ps(key_rows[c] + d0), v1 = _mm256_loadu_ps(key_rows[c] + d0 + 8);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * C + c);
      acc[h][0] = _mm256_fmadd_ps(ph, v0, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(ph, v1, acc[h][1]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    _mm256_storeu_ps(o + h * L + d0, acc[h][0]);
    _mm256_storeu_ps(o + h * L + d0 + 8, acc[h][1]);
  }
}

template <int NH>
void weighted_sum(const float* p, int64_t C, const float* const* key_rows, const bool* valid, int64_t c0, int64_t c1,
                  int64_t L, float* o) {
  int64_t d = 0;
  for (; d + 16 <= L; d += 16) weighted_sum16<NH>(p, C, key_rows, valid, c0, c1, d, o, L);
  for (; d < L; ++d)
    for (int h = 0; h < NH; ++h) {
      float a = 0.f;
      for (int64_t c = c0; c < c1; ++c)
        if (valid[c]) a += p[h * C + c] * key_rows[c][d];
      o[h * L + d] = a;
    }
}

std::tuple<at::Tensor, at::Tensor> paged_mla_decode(const at::Tensor& q_, const at::Tensor& kv_, const at::Tensor& tables_,
                                                    const at::Tensor& valid_, int64_t L, double scale) {
  TORCH_CHECK(q_.device().is_cpu() && kv_.device().is_cpu() && tables_.device().is_cpu() && valid_.device().is_cpu(),
              "paged_mla_decode: CPU tensors only");
  TORCH_CHECK(q_.scalar_type() == at::kFloat && (kv_.scalar_type() == at::kFloat || kv_.scalar_type() == at::kBFloat16),
              "paged_mla_decode: fp32 queries, an fp32 or bf16 pool");
  TORCH_CHECK(q_.dim() == 3 && kv_.dim() == 3 && tables_.dim() == 2 && valid_.dim() == 2,
              "paged_mla_decode: q [T, H, Dc], kv_cache [NB, bs, Dc], block_tables [T, B], valid [T, B * bs]");
  const at::Tensor q = q_.contiguous(), kv = kv_.contiguous();
  const at::Tensor tables = tables_.to(at::kLong).contiguous(), valid = valid_.to(at::kBool).contiguous();
  const int64_t T = q.size(0), H = q.size(1), Dc = q.size(2), NB = kv.size(0), bs = kv.size(1), B = tables.size(1);
  const int64_t C = B * bs;
  TORCH_CHECK(kv.size(2) == Dc, "paged_mla_decode: q has Dc = ", Dc, ", the pool ", kv.size(2));
  TORCH_CHECK(0 < L && L <= Dc, "paged_mla_decode: kv_lora_rank ", L, " not in (0, ", Dc, "]");
  TORCH_CHECK(tables.size(0) == T && valid.size(0) == T && valid.size(1) == C,
              "paged_mla_decode: block_tables [", T, ", B] and valid [", T, ", B * ", bs, "] expected");
  // every task writes its heads' rows of o (zeros where the token has no valid key): a zero fill of the whole
  // output first cost 27 us a call (16 tokens, `mid`: 8 heads x 256), 0.2 ms of a 16-sequence decode step
  at::Tensor o = at::empty({T, H, L}, q.options());
  at::Tensor lse = at::empty({T, H}, q.options());
  const float* qp = q.data_ptr<float>();
  const bool narrow = kv.scalar_type() == at::kBFloat16;
  const float* kvp = narrow ? nullptr : kv.data_ptr<float>();
  const at::BFloat16* kvb = narrow ? kv.data_ptr<at::BFloat16>() : nullptr;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < T * B; ++i)    // bad block ids would read out of the pool: check before any thread runs
    TORCH_CHECK(0 <= tp[i] && tp[i] < NB, "paged_mla_decode: block id ", tp[i], " outside the pool of ", NB);

  // Tasks are (token, slice of HS heads): with fewer tokens than threads (batch-1 decode) the heads are split in
  // halves while that leaves at least 4 heads a slice, so one token's attention uses more than one core.
  int64_t HS = H;
  while (T * (H / HS) < at::get_num_threads() && HS % 2 == 0 && HS / 2 >= 4) HS /= 2;
  const int64_t slices = H / HS;
  at::parallel_for(0, T * slices, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(HS * C);  // head-major [HS][C]: scores, then probabilities
    std::vector<const float*> key_rows(C);
    std::vector<float> widened;         // a bf16 pool: the task's span of keys in fp32, [c1 - c0][Dc]
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / slices, h0 = (task % slices) * HS;
      const float* qt = qp + (t * H + h0) * Dc;
      const bool* vt = vp + t * C;
      const int64_t* tt = tp + t * B;
      float* ot = op + (t * H + h0) * L;
      float* lt = lp + t * H + h0;
      int64_t c0 = 0, c1 = C;            // only the span of valid keys is read
      while (c0 < C && !vt[c0]) ++c0;
      while (c1 > c0 && !vt[c1 - 1]) --c1;
      if (c0 == c1) {
        for (int64_t h = 0; h < HS; ++h) lt[h] = neg_inf;
        std::fill(ot, ot + HS * L, 0.f);
        continue;
      }
      if (narrow) {
        widened.resize((c1 - c0) * Dc);
        for (int64_t c = c0; c < c1; ++c) {
          float* row = widened.data() + (c - c0) * Dc;
          widen_row(kvb + (tt[c / bs] * bs + c % bs) * Dc, Dc, row);
          key_rows[c] = row;
        }
      } else {
        for (int64_t c = c0; c < c1; ++c) key_rows[c] = kvp + (tt[c / bs] * bs + c % bs) * Dc;
      }
      float* sc = scores.data();
      if (HS % 8 == 0) score_keys<8>(qt, key_rows.data(), c0, c1, HS, Dc, sc, C);
      else if (HS % 4 == 0) score_keys<4>(qt, key_rows.data(), c0, c1, HS, Dc, sc, C);
      else if (HS % 2 == 0) score_keys<2>(qt, key_rows.data(), c0, c1, HS, Dc, sc, C);
      else score_keys<1>(qt, key_rows.data(), c0, c1, HS, Dc, sc, C);
      for (int64_t h = 0; h < HS; ++h) {  // softmax over the valid keys, per head
        float* row = sc + h * C;
        float mx = neg_inf;
        for (int64_t c = c0; c < c1; ++c) {
          row[c] = vt[c] ? row[c] * s : neg_inf;
          if (!(row[c] <= mx)) mx = row[c];   // NaN propagates, as in the torch form
        }
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + c), mv));
          _mm256_storeu_ps(row + c, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        alignas(32) float part[8];
        _mm256_store_ps(part, sum8);
        float sum = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
        for (; c < c1; ++c) {
          row[c] = std::exp(row[c] - mx);
          sum += row[c];
        }
        for (c = c0; c < c1; ++c) {       // masked keys: exactly zero (the vector exp clamps -inf)
          if (!vt[c]) {
            sum -= row[c];
            row[c] = 0.f;
          }
        }
        const float inv = 1.f / sum;
        for (c = c0; c < c1; ++c) row[c] *= inv;
        lt[h] = mx + std::log(sum);
      }
      int64_t h = 0;
      for (; h + 4 <= HS; h += 4) weighted_sum<4>(sc + h * C, C, key_rows.data(), vt, c0, c1, L, ot + h * L);
      for (; h < HS; ++h) weighted_sum<1>(sc + h * C, C, key_rows.data(), vt, c0, c1, L, ot + h * L);
    }
  });
  return {o, lse};
}

// deepinfer::paged_mla_decode on CPU: the kernel for fp32 queries over an fp32 or bf16 pool; other dtypes the graph
// form (gather, two bmm).
std::tuple<at::Tensor, at::Tensor> paged_mla_decode_cpu(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                                                        const at::Tensor& valid, int64_t L, double scale) {
  if (q.scalar_type() == at::kFloat && (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16))
    return paged_mla_decode(q, kv, tables, valid, L, scale);
  const int64_t T = q.size(0);
  const at::Tensor ctx =
      kv.index_select(0, tables.reshape(-1)).view({T, tables.size(1) * kv.size(1), kv.size(2)}).to(q.scalar_type());
  at::Tensor scores = at::bmm(q, ctx.transpose(1, 2)).to(at::kFloat).mul(scale);
  scores.masked_fill_(valid.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  at::Tensor mx = std::get<0>(scores.max(-1, true));
  mx = at::where(at::isfinite(mx), mx, at::zeros_like(mx));
  const at::Tensor e = at::exp(scores - mx), denom = e.sum(-1, true);
  at::Tensor o = at::bmm(e.to(ctx.scalar_type()), ctx.narrow(2, 0, L)).to(at::kFloat) / denom.clamp_min(1e-30);
  at::Tensor lse = at::where(denom > 0, mx + at::log(denom.clamp_min(1e-30)), at::full_like(mx, -INFINITY));
  return {o, lse.squeeze(-1)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("paged_mla_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor valid, int kv_lora_rank, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("paged_mla_decode", paged_mla_decode);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {   // runtime/ops.py defines the op; on CPU this replaces its Python body
  m.impl("paged_mla_decode", paged_mla_decode_cpu);
}

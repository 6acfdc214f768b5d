// deepinfer_cpu::paged_mla_decode: absorbed multi-head latent attention for decode tokens, straight from the
// paged latent pool, fp32 math, x86-64 AVX2 + FMA.
//
//   q [T, H, Dc]            each token's absorbed query (W_UK folded into the nope part, then the rope part)
//   kv_cache [NB, bs, Dc]   the latent pool: per slot the normed c_kv (first kv_lora_rank) and the roped k_pe;
//                           fp32, or bf16 (--dtype bfloat16): widened in registers as the tiles load them
//   block_tables [T, B]     each token's pool blocks, in key order (key c lives in block c / bs, slot c % bs)
//   valid [T, B * bs]       which keys each token attends to (its own positions so far; with CP, those it owns)
//   -> o [T, H, kv_lora_rank] = softmax(scale * q . k) . c_kv over the valid keys (zero where none is),
//      lse [T, H]             the log-sum-exp of the scaled scores (-inf where no key is valid), for the
//                             context-parallel merge of partial attentions.
//
// The graph form gathers every token's context into a fresh [T, C, Dc] buffer and runs two batched GEMMs over it;
// here each token's keys are read where they lie, in blocks of kKeyBlock valid keys: a block is scored against all
// the token's heads (4 heads x 3 keys a register tile), folded into each head's running softmax (flash decoding's
// online form: the sums so far rescaled when the max rises) and summed into the output (4 heads x 24 lanes a tile)
// while its rows are still in cache, the rows kPrefetchRows keys ahead prefetched: no gather, no [T, H, C] round
// trip through memory, each key read from memory once. Tokens run in parallel on torch's thread pool. Built with
// grouped_rows_mm.cpp by runtime/cpu_kernels.py.
//
// The first form scored a token's whole span of keys, then summed it 16 output lanes at a time (the span re-read
// for each 16 lanes: from memory once it passed L2), 8 heads x 1 key a score tile (9 loads to 8 FMAs), no
// prefetch. Against it, on a 2-core Zen 4 VM, pools out of cache (rotated through ~96 MB), best of 3 interleaved
// rounds: `mid` (8 heads, 256 + 32) at 16 tokens x 128 / 512 / 2048 keys 1.29x / 1.45x / 1.97x (fp32 pool),
// 1.16x / 1.39x / 1.71x (bf16), one token x 2048 keys 2.4x / 1.7x; V2-Lite widths (16 heads, 512 + 64) 1.65x /
// 1.77x / 2.09x and 1.37-1.59x. Inside the engine (the op timed in place, the two forms alternating run by run, 16
// sequences of `mid`): 1.40x at 256-496 keys, 1.30x at 32-232 (`mid-bf16`). A bf16 pool's rows are widened in
// registers as the tiles load them: against widening each block into an fp32 buffer first, 1.03-1.25x (the same
// runs' harness; fp32 pools 1.00-1.08x, the same code).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using deepinfer_simd::exp_nonpositive;
using deepinfer_simd::hsum8;
using deepinfer_simd::load_bf16;

// Eight keys' values from a pool row, fp32 or bf16 (widened in registers: exact), and one value.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16(p); }
inline float value(float v) { return v; }
inline float value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Keys a block: each block of a token's valid keys is scored, folded into the running softmax and summed into the
// output while its rows are in cache (an online softmax, as flash decoding), so a long context's keys are read from
// memory once. The first form scored the whole span, then summed it 16 output lanes at a time: a span past L2
// (2048 keys of `mid`, 2.3 MB) came from memory again for every 16 lanes.
constexpr int64_t kKeyBlock = 32;
// Software prefetch distance, in keys: the pool's rows come from memory (a layer's KV is read once a step).
constexpr int64_t kPrefetchRows = 8;

// The horizontal sums of acc[0..N) -> out[0..N), eight at a time in one hadd tree.
template <int N>
inline void hsums(const __m256* acc, float* out) {
  alignas(32) float r[8];
#pragma GCC unroll 2
  for (int i = 0; i < N; i += 8) {
    if (i + 8 <= N) {
      _mm256_store_ps(r, hsum8(acc + i));
    } else {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = i + j < N ? acc[i + j] : _mm256_setzero_ps();
      _mm256_store_ps(r, hsum8(a));
    }
    for (int j = 0; j < 8 && i + j < N; ++j) out[i + j] = r[j];
  }
}

// Scores of NH heads x NK keys in one pass over Dc: s[h * lds + k] = q[h] . key[k] (unscaled). 4 x 3: 12
// accumulators, 7 loads to 12 FMAs.
template <int NH, int NK, typename KT>
inline void score_tile(const float* q, const KT* const* keys, int64_t Dc, float* s, int64_t lds,
                       const char* const* pf) {
  __m256 acc[NH * NK];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NK; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= Dc; d += 8) {
    if (pf != nullptr && (d & 15) == 0) {
#pragma GCC unroll 8
      for (int k = 0; k < NK; ++k) _mm_prefetch(pf[k] + sizeof(KT) * d, _MM_HINT_T1);
    }
    __m256 kv[NK];
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) kv[k] = load8(keys[k] + d);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * Dc + d);
#pragma GCC unroll 8
      for (int k = 0; k < NK; ++k) acc[h * NK + k] = _mm256_fmadd_ps(qv, kv[k], acc[h * NK + k]);
    }
  }
  float r[NH * NK];
  hsums<NH * NK>(acc, r);
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NK; ++k) {
      float v = r[h * NK + k];
      for (int64_t dd = d; dd < Dc; ++dd) v += q[h * Dc + dd] * value(keys[k][dd]);
      s[h * lds + k] = v;
    }
}

// Scores of heads [0, HS) against a block's n keys -> s[h * kKeyBlock + k]: 4 heads x 3 keys a tile, the other
// heads one at a time x 8 keys; a tile past the last key repeats it and keeps the real results only. The first
// pass over the keys (the first heads') prefetches the rows `ahead` (kPrefetchRows on, over the task's later keys:
// `ahead[k]` for key k of this block, n_ahead of them).
template <typename KT>
void score_block(const float* q, int64_t HS, int64_t Dc, const KT* const* keys, int64_t n, float* s,
                 const char* const* ahead, int64_t n_ahead) {
  const auto run = [&](auto nh, auto nk, int64_t h) {
    constexpr int NH = decltype(nh)::value, NK = decltype(nk)::value;
    for (int64_t k = 0; k < n; k += NK) {
      const KT* pad[NK];
      const KT* const* kk = keys + k;
      if (k + NK > n) {
        for (int j = 0; j < NK; ++j) pad[j] = keys[std::min(k + j, n - 1)];
        kk = pad;
      }
      const char* pfs[NK];
      const char* const* pf = nullptr;
      if (h == 0 && n_ahead > 0) {
        for (int j = 0; j < NK; ++j) pfs[j] = ahead[std::min(k + j, n_ahead - 1)];
        pf = pfs;
      }
      float tmp[NH * NK];
      score_tile<NH, NK>(q + h * Dc, kk, Dc, tmp, NK, pf);
      for (int hh = 0; hh < NH; ++hh)
        for (int j = 0; j < NK && k + j < n; ++j) s[(h + hh) * kKeyBlock + k + j] = tmp[hh * NK + j];
    }
  };
  int64_t h = 0;
  for (; h + 4 <= HS; h += 4) run(std::integral_constant<int, 4>{}, std::integral_constant<int, 3>{}, h);
  for (; h < HS; ++h) run(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{}, h);
}

// o[h * L + d0 ..+ 8 ND) += sum_k p[h * kKeyBlock + k] * key[k][d0 ..] for NH heads over a block's n keys, the
// accumulators in registers: 4 heads x 24 lanes, 7 loads to 12 FMAs.
template <int NH, int ND, typename KT>
inline void weighted_tile(const float* p, const KT* const* keys, int64_t n, int64_t d0, float* o, int64_t L) {
  __m256 acc[NH][ND];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 3
    for (int j = 0; j < ND; ++j) acc[h][j] = _mm256_loadu_ps(o + h * L + d0 + 8 * j);
  for (int64_t k = 0; k < n; ++k) {
    __m256 v[ND];
#pragma GCC unroll 3
    for (int j = 0; j < ND; ++j) v[j] = load8(keys[k] + d0 + 8 * j);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * kKeyBlock + k);
#pragma GCC unroll 3
      for (int j = 0; j < ND; ++j) acc[h][j] = _mm256_fmadd_ps(ph, v[j], acc[h][j]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 3
    for (int j = 0; j < ND; ++j) _mm256_storeu_ps(o + h * L + d0 + 8 * j, acc[h][j]);
}

// o[h] += sum_k p[h][k] * key[k][0 .. L) for heads [h0, h0 + NH).
template <int NH, typename KT>
void weighted_heads(const float* p, const KT* const* keys, int64_t n, int64_t L, float* o) {
  int64_t d = 0;
  for (; d + 24 <= L; d += 24) weighted_tile<NH, 3>(p, keys, n, d, o, L);
  for (; d + 8 <= L; d += 8) weighted_tile<NH, 1>(p, keys, n, d, o, L);
  for (; d < L; ++d)
    for (int h = 0; h < NH; ++h) {
      float a = o[h * L + d];
      for (int64_t k = 0; k < n; ++k) a += p[h * kKeyBlock + k] * value(keys[k][d]);
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
  const char* pool = static_cast<const char*>(kv.data_ptr());
  const int64_t row_bytes = Dc * kv.element_size();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < T * B; ++i)    // bad block ids would read out of the pool: check before any thread runs
    TORCH_CHECK(0 <= tp[i] && tp[i] < NB, "paged_mla_decode: block id ", tp[i], " outside the pool of ", NB);

  // Tasks are (token, slice of HS heads): with fewer tokens than threads (batch-1 decode) the heads are split in
  // halves while that leaves at least 4 heads a slice, so one token's attention uses more than one core. (Not for one
  // long sequence among short ones: a slice reads all its token's keys, and halving the heads only halves the FLOPs of
  // a memory-bound read; a 2048-key token among 15 of 64 keys measured 0.9x split.)
  const int64_t threads = at::get_num_threads();
  int64_t HS = H;
  while (T * (H / HS) < threads && HS % 2 == 0 && HS / 2 >= 4) HS /= 2;
  const int64_t slices = H / HS, tasks = T * slices;
  // The threads start on runs of equal estimated work, a task's valid keys plus a block's worth for its fixed costs
  // (sequences differ in context), and take what is left of the others' runs once done.
  std::vector<int64_t> work(tasks);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t nv = std::count(vp + t * C, vp + (t + 1) * C, true);
    for (int64_t i = 0; i < slices; ++i) work[t * slices + i] = nv + kKeyBlock;
  }
  const std::vector<int64_t> cut = deepinfer_parallel::equal_work_runs(work, std::min(threads, tasks));
  deepinfer_parallel::run_tasks(cut, [&] {
    return [&, sc = std::vector<float>(HS * kKeyBlock),   // a block's scores, then probabilities: [HS][kKeyBlock]
            mx = std::vector<float>(HS), sum = std::vector<float>(HS),  // each head's running max, sum of exp(s - max)
            rows = std::vector<const char*>(C)](int64_t task) mutable {   // the token's valid keys' rows, in key order
      const int64_t t = task / slices, h0 = (task % slices) * HS;
      const float* qt = qp + (t * H + h0) * Dc;
      const bool* vt = vp + t * C;
      const int64_t* tt = tp + t * B;
      float* ot = op + (t * H + h0) * L;
      float* lt = lp + t * H + h0;
      std::fill(ot, ot + HS * L, 0.f);
      std::fill(mx.begin(), mx.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), 0.f);
      int64_t nv = 0;
      for (int64_t c = 0; c < C; ++c)
        if (vt[c]) rows[nv++] = pool + (tt[c / bs] * bs + c % bs) * row_bytes;
      // the keys' rows as they are stored: fp32, or bf16 widened in registers as the tiles load them
      const auto blocks = [&](auto kt) {
        using KT = decltype(kt);
        for (int64_t i = 0; i < nv; i += kKeyBlock) {
          const int64_t n = std::min(kKeyBlock, nv - i);
          const KT* const* keys = reinterpret_cast<const KT* const*>(rows.data() + i);
          const int64_t pf0 = std::min(i + kPrefetchRows, nv);   // the rows kPrefetchRows keys ahead
          float* p = sc.data();
          score_block(qt, HS, Dc, keys, n, p, rows.data() + pf0, std::min(nv - pf0, n));
          for (int64_t h = 0; h < HS; ++h) {   // the running softmax: rescale what came before to the new max
            float* ph = p + h * kKeyBlock;
            float m = mx[h];
            for (int64_t k = 0; k < n; ++k) {
              ph[k] *= s;
              if (!(ph[k] <= m)) m = ph[k];    // NaN propagates, as in the torch form
            }
            if (m != mx[h]) {                  // (the first block: nothing to rescale, o and sum are zero)
              const float a = mx[h] == neg_inf ? 1.f : std::exp(mx[h] - m);
              if (a != 1.f) {
                sum[h] *= a;
                float* oh = ot + h * L;
                for (int64_t d = 0; d < L; ++d) oh[d] *= a;
              }
              mx[h] = m;
            }
            const __m256 mv = _mm256_set1_ps(m);
            int64_t k = 0;
            for (; k + 8 <= n; k += 8)
              _mm256_storeu_ps(ph + k, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(ph + k), mv)));
            for (; k < n; ++k) ph[k] = std::exp(ph[k] - m);
            float add = 0.f;
            for (k = 0; k < n; ++k) add += ph[k];
            sum[h] += add;
          }
          int64_t h = 0;
          for (; h + 4 <= HS; h += 4) weighted_heads<4>(p + h * kKeyBlock, keys, n, L, ot + h * L);
          for (; h < HS; ++h) weighted_heads<1>(p + h * kKeyBlock, keys, n, L, ot + h * L);
        }
      };
      if (narrow)
        blocks(uint16_t{});
      else
        blocks(float{});
      for (int64_t h = 0; h < HS; ++h) {
        if (nv == 0) {                       // no valid key: zeros, lse -inf
          lt[h] = neg_inf;
          continue;
        }
        const float inv = 1.f / sum[h];
        float* oh = ot + h * L;
        for (int64_t d = 0; d < L; ++d) oh[d] *= inv;
        lt[h] = mx[h] + std::log(sum[h]);
      }
    };
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

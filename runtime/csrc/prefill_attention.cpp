// deepinfer_cpu::prefill_attention: the attention of a prefill chunk's queries over its packed context, fp32,
// x86-64 (AVX2 for the softmax; the products through the BLAS's sgemm).
//
//   q [T, H, D]          the chunk's queries (nope and rope parts together)
//   k [C, H, D]          the context's keys, per head (the latents expanded by W_UK, the shared rope key)
//   v [C, H, Dv]         the context's values, per head
//   starts [T]           where each query's sequence begins in the packed context
//   positions [T]        each query's position in its sequence: it attends to keys starts .. starts + position
//   -> o [T, H, Dv] = softmax(scale * q . k) . v over each query's keys (zero for a query with none).
//
// The graph form scores every query against the whole context bucket ([H, T, C] written, masked, read by the
// softmax, written again and read by the second product), though a chunk's causal mask leaves half of it or more
// unused. Here each task (QB queries, one head) scores only the keys its queries can see, one contiguous span
// per query (their union for the block), keeps the scores in a buffer the size of that span, and applies the
// softmax and the values while they are in cache. Tasks run on torch's thread pool, the most expensive first,
// each thread taking the next. Token-major operands, as the projections write them and o_proj reads the result.
// bf16 operands (--matmul-dtype bfloat16) where the CPU has bf16 dot products: both products of a task through
// oneDNN's bf16 GEMM (torch's at::mm over bf16 views, one thread inside the task), the scores and the output
// rounded to bf16 as bf16 GEMMs write them, the softmax in fp32 between, the probabilities rounded to bf16 once.
// Elsewhere bf16 operands are widened for the fp32 form (the same products, summed in fp32 and not rounded).
// Built with the other kernels by runtime/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <dlfcn.h>

namespace {

using deepinfer_simd::exp_nonpositive;

// The BLAS's sgemm (MKL's in torch's x86 wheels, exported by libtorch_cpu), found at run time: one call per score
// block and one per weighted sum, single-threaded inside the task's thread. Without it the op takes the torch form.
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);

sgemm_fn blas_sgemm() {
  static const sgemm_fn f = [] {
    void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
    if (sym == nullptr)                 // torch's library loaded without its symbols in the global scope
      if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, "sgemm_");
    return reinterpret_cast<sgemm_fn>(sym);
  }();
  return f;
}

// Queries a task. Against 16 and 32 (a 2-core Zen 3 VM, 2 threads): the demo model's chunk (4 heads, 256 queries,
// context 256) 0.27 against 0.34 ms; 16 heads of 192/128 dims over a 1024-key context 19 against 20-30 ms. Larger
// blocks score more of the masked triangle by the diagonal; smaller ones run the GEMMs at a lower rate.
constexpr int64_t QB = 64;

// Row r's scores s[0, n) -> its probabilities over its own keys [a, b) (scaled, max subtracted, normalised) and
// exact zeros elsewhere in [0, n).
void softmax_span(float* s, int64_t n, int64_t a, int64_t b, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan8 = _mm256_setzero_ps();
  int64_t c = a;
  for (; c + 8 <= b; c += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + c), sv);
    mx8 = _mm256_max_ps(mx8, x);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, mx8);
  float mx = *std::max_element(part, part + 8);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (; c < b; ++c) {
    const float x = s[c] * scale;
    mx = std::max(mx, x);
    nan |= std::isnan(x);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();    // NaN propagates, as in the torch form
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (c = a; c + 8 <= b; c += 8) {
    const __m256 e = exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(s + c), sv, mv));
    _mm256_storeu_ps(s + c, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  _mm256_store_ps(part, sum8);
  float sum = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
  for (; c < b; ++c) {
    s[c] = std::exp(s[c] * scale - mx);
    sum += s[c];
  }
  const float inv = 1.f / sum;
  const __m256 iv = _mm256_set1_ps(inv);
  for (c = a; c + 8 <= b; c += 8) _mm256_storeu_ps(s + c, _mm256_mul_ps(_mm256_loadu_ps(s + c), iv));
  for (; c < b; ++c) s[c] *= inv;
  std::fill(s, s + a, 0.f);
  std::fill(s + b, s + n, 0.f);
}

// The torch form (masked scores over the whole context, softmax): other dtypes, and where no BLAS sgemm was found.
at::Tensor torch_form(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                      const at::Tensor& positions, double scale) {
  const at::Tensor key = at::arange(k.size(0), starts.options().dtype(at::kLong));
  const at::Tensor rel = key.unsqueeze(0) - starts.to(at::kLong).unsqueeze(1);
  const at::Tensor valid = rel.ge(0).logical_and(rel.le(positions.to(at::kLong).unsqueeze(1)));     // [T, C]
  at::Tensor scores = at::matmul(q.transpose(0, 1), k.permute({1, 2, 0})).to(at::kFloat).mul(scale);  // [H, T, C]
  scores.masked_fill_(valid.logical_not().unsqueeze(0), -std::numeric_limits<double>::infinity());
  at::Tensor mx = std::get<0>(scores.max(-1, true));
  mx = at::where(at::isfinite(mx), mx, at::zeros_like(mx));
  const at::Tensor e = at::exp(scores - mx), denom = e.sum(-1, true);
  const at::Tensor o = at::matmul(e.to(v.scalar_type()), v.transpose(0, 1)).to(at::kFloat) / denom.clamp_min(1e-30);
  return o.transpose(0, 1).contiguous();                                                      // [T, H, Dv]
}

// The tasks of one call. Each query's keys are one span [lo, hi) of the context (empty for a padding query); a block
// of QB queries is scored against the union of its queries' spans [blo, bhi). The blocks with keys, the most keys
// first: tasks (block, head) are taken from a shared counter in that order, so the causal chunk's heavy last blocks
// do not all land on one thread. Blocks without keys (padding only) are zeroed in o here.
struct Tasks {
  std::vector<int64_t> lo, hi, blo, bhi, order;
};

Tasks plan_tasks(const at::Tensor& starts, const at::Tensor& positions, int64_t C, at::Tensor& o) {
  const int64_t T = starts.size(0), NQ = (T + QB - 1) / QB;
  Tasks p{std::vector<int64_t>(T), std::vector<int64_t>(T), std::vector<int64_t>(NQ, C), std::vector<int64_t>(NQ, 0), {}};
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    p.lo[t] = std::max<int64_t>(sp[t], 0);
    p.hi[t] = pp[t] < 0 ? p.lo[t] : std::min(sp[t] + pp[t] + 1, C);
    if (p.hi[t] < p.lo[t]) p.hi[t] = p.lo[t];
    if (p.hi[t] > p.lo[t]) {
      p.blo[t / QB] = std::min(p.blo[t / QB], p.lo[t]);
      p.bhi[t / QB] = std::max(p.bhi[t / QB], p.hi[t]);
    }
  }
  for (int64_t b = 0; b < NQ; ++b) {
    if (p.bhi[b] > p.blo[b]) p.order.push_back(b);
    else o.narrow(0, b * QB, std::min(T, (b + 1) * QB) - b * QB).zero_();
  }
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](int64_t x, int64_t y) { return p.bhi[x] - p.blo[x] > p.bhi[y] - p.blo[y]; });
  return p;
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                  const at::Tensor& positions) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && starts.dim() == 1 && positions.dim() == 1,
              "prefill_attention: q [T, H, D], k [C, H, D], v [C, H, Dv], starts [T], positions [T]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && k.size(2) == D && v.size(0) == k.size(0),
              "prefill_attention: q [", T, ", ", H, ", ", D, "] needs k [C, ", H, ", ", D, "] and v [C, ", H, ", Dv]");
  TORCH_CHECK(starts.size(0) == T && positions.size(0) == T, "prefill_attention: starts and positions need ", T, " rows");
  TORCH_CHECK(H * std::max(D, v.size(2)) <= INT32_MAX && k.size(0) <= INT32_MAX,
              "prefill_attention: sizes beyond the BLAS's int");
}

// One task in fp32: nr query rows (q, row stride ldq) scored against n key rows (k, row stride ldk), each query's
// softmax over its own span [lo[r], hi[r]) (context positions; the key rows start at c0), the weighted sum of the n
// value rows (v, row stride ldv) -> out (row stride ldo). The scores in buf, [nr, n].
void fp32_task(sgemm_fn gemm, const float* q, int ldq, const float* k, int ldk, const float* v, int ldv, int64_t nr,
               int64_t n, int64_t D, int64_t Dv, const int64_t* lo, const int64_t* hi, int64_t c0, float s,
               std::vector<float>& buf, float* out, int ldo) {
  buf.resize(static_cast<size_t>(nr * n));
  const float one = 1.f, zero = 0.f;
  // Scores [nr, n] = q rows . k rows (column-major for the BLAS: [n, nr] = k^T-transposed times q^T).
  const int m_ = static_cast<int>(n), n_ = static_cast<int>(nr), d_ = static_cast<int>(D), dv_ = static_cast<int>(Dv);
  gemm("T", "N", &m_, &n_, &d_, &one, k, &ldk, q, &ldq, &zero, buf.data(), &m_);
  for (int64_t r = 0; r < nr; ++r) {
    if (hi[r] > lo[r]) softmax_span(buf.data() + r * n, n, lo[r] - c0, hi[r] - c0, s);
    else std::fill(buf.data() + r * n, buf.data() + (r + 1) * n, 0.f);
  }
  // out rows [nr, Dv] = probabilities [nr, n] . v rows [n, Dv].
  gemm("N", "N", &dv_, &n_, &m_, &one, v, &ldv, buf.data(), &m_, &zero, out, &ldo);
}

at::Tensor prefill_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& starts_,
                             const at::Tensor& positions_, double scale) {
  check_shapes(q_, k_, v_, starts_, positions_);
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k_.scalar_type() == at::kFloat && v_.scalar_type() == at::kFloat,
              "prefill_attention: fp32 only");
  const sgemm_fn gemm = blas_sgemm();
  if (gemm == nullptr) return torch_form(q_, k_, v_, starts_, positions_, scale);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor starts = starts_.to(at::kLong).contiguous(), positions = positions_.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), C = k.size(0), Dv = v.size(2);
  at::Tensor o = at::empty({T, H, Dv}, q.options());
  if (H == 0 || T == 0 || C == 0) return o.zero_();
  const Tasks p = plan_tasks(starts, positions, C, o);
  const std::vector<int64_t>&lo = p.lo, &hi = p.hi, &blo = p.blo, &bhi = p.bhi, &order = p.order;
  const int64_t tasks = static_cast<int64_t>(order.size()) * H;
  std::atomic<int64_t> next{0};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int ldqk = static_cast<int>(H * D), ldv = static_cast<int>(H * Dv);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t b = order[task / H], h = task % H;
      const int64_t t0 = b * QB, nr = std::min(T, t0 + QB) - t0, c0 = blo[b], n = bhi[b] - c0;
      fp32_task(gemm, qp + (t0 * H + h) * D, ldqk, kp + (c0 * H + h) * D, ldqk, vp + (c0 * H + h) * Dv, ldv, nr, n, D,
                Dv, lo.data() + t0, hi.data() + t0, c0, s, buf, op + (t0 * H + h) * Dv, ldv);
    }
  });
  return o;
}

bool cpu_has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

// bf16 n values -> fp32.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, deepinfer_simd::load_bf16(src + i));
  for (; i < n; ++i) {
    const uint32_t b = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &b, 4);
  }
}

// bf16 q, k, v where the CPU has bf16 dot products: the same tasks as the fp32 form, each product one at::mm over
// bf16 views into per-thread buffers. A 2-core Zen 4 VM, one thread, against MKL's sgemm at the same shapes: 64
// queries x 96 dims over 2048 keys 1.85x, the weighted sum over them 1.9x; over 256 keys 1.0-1.15x, where the
// calls' fixed cost (~10-20 us each) takes the gain: tasks with less work a query row than this (keys x (D + Dv):
// 320 keys at `mid`'s 96 + 64 dims) take the fp32 form. At the demo model's 48 + 32 dims the bf16 form over 320-512
// keys ran 0.95x.
constexpr int64_t kBf16MinWork = 51200;

at::Tensor prefill_attention_bf16(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                  const at::Tensor& starts_, const at::Tensor& positions_, double scale) {
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor starts = starts_.to(at::kLong).contiguous(), positions = positions_.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), C = k.size(0), Dv = v.size(2);
  at::Tensor o = at::empty({T, H, Dv}, q.options().dtype(at::kFloat));
  if (H == 0 || T == 0 || C == 0) return o.zero_();
  const Tasks p = plan_tasks(starts, positions, C, o);
  const std::vector<int64_t>&lo = p.lo, &hi = p.hi, &blo = p.blo, &bhi = p.bhi, &order = p.order;
  const int64_t tasks = static_cast<int64_t>(order.size()) * H;
  std::atomic<int64_t> next{0};
  auto* qp = reinterpret_cast<uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
  float* op = o.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const auto bf = q.options();
  const sgemm_fn gemm = blas_sgemm();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<uint16_t> scores, probs, outs;    // bf16 [nr, n], [nr, n], [nr, Dv]
    std::vector<float> row;                       // one row's scores, then probabilities, fp32
    std::vector<float> wq, wk, wv, buf;           // the fp32 form's widened operands and scores
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t b = order[task / H], h = task % H;
      const int64_t t0 = b * QB, nr = std::min(T, t0 + QB) - t0, c0 = blo[b], n = bhi[b] - c0;
      if (n * (D + Dv) < kBf16MinWork && gemm != nullptr) {
        // Few keys: the two at::mm calls' fixed cost outweighs the faster products. The fp32 form's task on this
        // task's rows, widened (a few % of its products' time).
        wq.resize(static_cast<size_t>(nr * D));
        wk.resize(static_cast<size_t>(n * D));
        wv.resize(static_cast<size_t>(n * Dv));
        for (int64_t r = 0; r < nr; ++r) widen_bf16(qp + ((t0 + r) * H + h) * D, wq.data() + r * D, D);
        for (int64_t c = 0; c < n; ++c) {
          widen_bf16(kp + ((c0 + c) * H + h) * D, wk.data() + c * D, D);
          widen_bf16(vp + ((c0 + c) * H + h) * Dv, wv.data() + c * Dv, Dv);
        }
        fp32_task(gemm, wq.data(), static_cast<int>(D), wk.data(), static_cast<int>(D), wv.data(), static_cast<int>(Dv), nr,
                  n, D, Dv, lo.data() + t0, hi.data() + t0, c0, s, buf, op + (t0 * H + h) * Dv, static_cast<int>(H * Dv));
        continue;
      }
      scores.resize(static_cast<size_t>(nr * n));
      probs.resize(static_cast<size_t>(nr * n));
      outs.resize(static_cast<size_t>(nr * Dv));
      row.resize(static_cast<size_t>(n));
      const at::Tensor qh = at::from_blob(qp + (t0 * H + h) * D, {nr, D}, {H * D, 1}, bf);
      const at::Tensor kh = at::from_blob(kp + (c0 * H + h) * D, {D, n}, {1, H * D}, bf);     // k rows, transposed
      at::Tensor sc = at::from_blob(scores.data(), {nr, n}, bf);
      at::mm_out(sc, qh, kh);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t t = t0 + r;
        uint16_t* pr = probs.data() + r * n;
        if (hi[t] > lo[t]) {
          widen_bf16(scores.data() + r * n, row.data(), n);
          softmax_span(row.data(), n, lo[t] - c0, hi[t] - c0, s);
          deepinfer_simd::narrow_bf16(row.data(), pr, n);
        } else {
          std::fill(pr, pr + n, uint16_t{0});
        }
      }
      const at::Tensor ph = at::from_blob(probs.data(), {nr, n}, bf);
      const at::Tensor vh = at::from_blob(vp + (c0 * H + h) * Dv, {n, Dv}, {H * Dv, 1}, bf);
      at::Tensor oh = at::from_blob(outs.data(), {nr, Dv}, bf);
      at::mm_out(oh, ph, vh);
      for (int64_t r = 0; r < nr; ++r) widen_bf16(outs.data() + r * Dv, op + ((t0 + r) * H + h) * Dv, Dv);
    }
  });
  return o;
}

// deepinfer::prefill_attention on CPU: the kernel for fp32; for bf16 its bf16 form where the CPU has bf16 dot
// products, else the fp32 kernel on the widened operands; the torch form for other dtypes.
at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                                 const at::Tensor& positions, double scale) {
  const auto f32 = at::kFloat, b16 = at::kBFloat16;
  if (q.scalar_type() == f32 && k.scalar_type() == f32 && v.scalar_type() == f32)
    return prefill_attention(q, k, v, starts, positions, scale);
  if (q.scalar_type() == b16 && k.scalar_type() == b16 && v.scalar_type() == b16) {
    check_shapes(q, k, v, starts, positions);
    if (cpu_has_bf16_dot()) return prefill_attention_bf16(q, k, v, starts, positions, scale);
    return prefill_attention(q.to(f32), k.to(f32), v.to(f32), starts, positions, scale);
  }
  return torch_form(q, k, v, starts, positions, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("prefill_attention", prefill_attention);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {   // runtime/ops.py defines the op; on CPU this replaces its Python body
  m.impl("prefill_attention", prefill_attention_cpu);
}

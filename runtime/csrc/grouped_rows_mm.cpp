// deepinfer_cpu::grouped_rows_mm: a grouped GEMM for groups of a few rows, x86-64 AVX2 + FMA: fp32 rows, fp32 or
// bf16 weights (widened in registers as they stream: half the bytes of a memory-bound read), fp32 math.
//
//   out[r, n] = sum_k x[r, k] * wt[g, n, k]   for the rows r of group g (offs: cumulative row ends, int32/64);
//   rows at or past offs[G-1] are zero.
//
// MoE experts: a handful (decode) to a few dozen (prefill chunks) of (token, expert) rows per expert, each
// expert's weight a few MB. MKL's sgemm at that shape runs far under both the memory and the FLOP peak; here each
// group's weight streams from memory once, kNW weight rows at a time, and meets up to 4 of the group's rows
// (L1-resident) at a time in 12 register accumulators; groups of a dozen rows or more (16-row decode buckets'
// linears, prefill chunks' experts) instead meet 16 weight rows at a time transposed into an L2 panel, 6 rows at a
// time in outer-product register tiles, and groups of 14-16 rows (a 16-row decode bucket) are transposed instead, the
// weights broadcast against them. Where the CPU has AVX-512, a form with 4 x 6 tiles of 16-lane accumulators, blocked
// for L2 (and its own transposed form for 14-16 rows), runs instead: it beats MKL's sgemm at any number of rows, so
// the CPU ops take it for prefill chunks and their linears too. Where it has AVX512-BF16, bf16 rows meet bf16 weights
// in dot-product instructions (--matmul-dtype bfloat16), 14-16-row groups again transposed.
// Built at first use by runtime/cpu_kernels.py (torch.utils.cpp_extension); torch's own thread pool runs it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using deepinfer_simd::hsum;
using deepinfer_simd::hsum8;

// Weight loads, fp32 or bf16 (widened to fp32).
inline __m256 wload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 wload(const at::BFloat16* p) { return deepinfer_simd::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline float wscalar(float v) { return v; }
inline float wscalar(at::BFloat16 v) { return static_cast<float>(v); }

constexpr int kNW = 3;            // weight rows per register tile (3 x 4 accumulators + 3 + 1 = 16 ymm)
constexpr int64_t kBlockN = 48;   // weight rows per parallel task
// Software prefetch: each weight row's read position plus 16 KB (4096 floats, 8192 bf16), i.e. for shorter rows
// into the rows of the tiles that follow. The hardware prefetchers alone kept the expert GEMM (`mid` model, 64 rows in 16
// groups, weights out of cache) at 14-17 GB/s; with this, in the same runs, 17-21 GB/s (3-16K floats ahead all
// alike; 1K or less no gain). Prefetching along each row instead, wrapping into the same row of the next tile,
// was no better (0.93-1.10x at K = 512, 1024, 2048). One-row groups (decode at batch 1) of fp32 weights go without:
// their loop is load-bound already, and there it cost 5-15% (AVX2; a 2-core Zen 3 VM again in 2026-12: 0.84-0.98x
// the speed at 1.2-67 MB, 1.1x at one 2 MB weight). Of bf16 weights they prefetch: on that VM 1.14-1.25x faster (the
// `mid` model's one-row linears, 0.6-34 MB, 8.5-12.9 -> 10.8-15.1 GB/s, where torch's sum() of the same bf16
// weights reads 14-16). The AVX-512 form below prefetches them all, measured faster.
// Into L2 (T1), not L1: on a 2-core Zen 4 VM, weights out of cache (ten layers' experts in turn), the `mid` experts
// at 64 rows over 16 groups ran 1.3x (gate-up, K = 1024) and 1.5-1.8x (down, K = 512) faster, fp32 and bf16 rows
// alike, and the 16384 x 1024 head at 2-16 rows 1.0-1.4x (three interleaved runs each): an L1 prefetch holds
// one of L1's few miss buffers until the line arrives, and the kernel runs out of them long before the memory
// bus is busy (two threads ran exactly twice as fast as one).
constexpr int64_t kPrefetchBytes = 16384;

// NW weight rows (w, row stride K) against R activation rows (x, row stride K) -> out[j * ldo + i]. PF: the
// first pass over these weight rows, which prefetches kPrefetchBytes ahead of each row it reads, a cache line
// at a time.
template <int NW, int R, bool PF, typename W>
inline void tile(const W* w, const float* x, int64_t K, float* out, int64_t ldo) {
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(W), kLine = 64 / sizeof(W);
  __m256 acc[NW][R];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < R; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) wv[i] = wload(w + i * K + k);
    if (PF && (k & (kLine - 1)) == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + kAhead), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int j = 0; j < R; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  // Horizontal sums, eight accumulators at a time in one hadd tree (a few: one by one). At K = 256 the
  // one-by-one sums were ~20% of the kernel: 16 rows x 4096 x 256 ran at 84 GFLOP/s, 106 with the tree.
  constexpr int NA = NW * R, NC = (NA + 7) / 8;
  alignas(32) float sums[NC * 8];
  if constexpr (NA < 6) {
    for (int t = 0; t < NA; ++t) sums[t] = hsum(acc[t / R][t % R]);
  } else {
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) {
      __m256 a[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) a[t] = c * 8 + t < NA ? acc[(c * 8 + t) / R][(c * 8 + t) % R] : _mm256_setzero_ps();
      _mm256_store_ps(sums + 8 * c, hsum8(a));
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < R; ++j) {
      float s = sums[i * R + j];
      for (int64_t kk = k; kk < K; ++kk) s += wscalar(w[i * K + kk]) * x[j * K + kk];
      out[j * ldo + i] = s;
    }
}

template <int NW, typename W>
inline void weight_rows(const W* w, const float* x, int64_t rows, int64_t K, float* out, int64_t ldo) {
  int64_t r = 0;
  if (rows >= 4) {
    tile<NW, 4, true>(w, x, K, out, ldo);
    for (r = 4; r + 4 <= rows; r += 4) tile<NW, 4, false>(w, x + r * K, K, out + r * ldo, ldo);
  }
  const bool first = r == 0;
  switch (rows - r) {
    case 3: first ? tile<NW, 3, true>(w, x, K, out, ldo) : tile<NW, 3, false>(w, x + r * K, K, out + r * ldo, ldo); break;
    case 2: first ? tile<NW, 2, true>(w, x, K, out, ldo) : tile<NW, 2, false>(w, x + r * K, K, out + r * ldo, ldo); break;
    case 1:   // fp32 weights: load-bound, no room to prefetch; bf16 weights: prefetched on the first pass
      first && std::is_same_v<W, at::BFloat16> ? tile<NW, 1, true>(w, x, K, out, ldo)
                                               : tile<NW, 1, false>(w, x + r * K, K, out + r * ldo, ldo);
      break;
    default: break;
  }
}

// The parallel tasks over G groups of M rows (row ends `ends`, clamped to [0, M]) and N weight rows, block_n weight
// rows a task: task(g, n0, n1, r0, r1) for each non-empty group. Rows in no group are left as they are.
// The threads start on contiguous runs of tasks of equal estimated work, not of equal task counts (groups differ in
// rows: routing is uneven, and at tens of rows a group the work is the rows' FLOPs), and take what is left of the
// others' runs once done (deepinfer_parallel::run_tasks). A task's estimate is its
// weight rows x (its rows + kStreamRows), kStreamRows the rows' worth of FLOPs that streaming a weight row from
// memory costs (a one-row group is memory-bound).
constexpr int64_t kStreamRows = 8;

template <typename Task>
void for_each_task(int64_t M, int64_t G, int64_t N, const int64_t* ends, const Task& task, int64_t block_n = kBlockN) {
  const int64_t blocks = (N + block_n - 1) / block_n, tasks = G * blocks;
  const auto rows_of = [&](int64_t g, int64_t* r0, int64_t* r1) {
    *r0 = g == 0 ? 0 : std::clamp<int64_t>(ends[g - 1], 0, M);
    *r1 = std::clamp<int64_t>(ends[g], *r0, M);
  };
  const auto run = [&](int64_t t) {
    const int64_t g = t / blocks, n0 = (t % blocks) * block_n, n1 = std::min(N, n0 + block_n);
    int64_t r0, r1;
    rows_of(g, &r0, &r1);
    if (r1 > r0) task(g, n0, n1, r0, r1);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) run(t);
    return;
  }
  std::vector<int64_t> work(tasks, 0);
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g = t / blocks, n0 = (t % blocks) * block_n, n1 = std::min(N, n0 + block_n);
    int64_t r0, r1;
    rows_of(g, &r0, &r1);
    if (r1 > r0) work[t] = (n1 - n0) * (r1 - r0 + kStreamRows);
  }
  const std::vector<int64_t> cut = deepinfer_parallel::equal_work_runs(work, threads);
  deepinfer_parallel::run_tasks(cut, [&] { return run; });
}

// ---- groups of kPanelMinRows+ rows (AVX2): outer products over transposed panels ----
//
// With a dozen rows or more the tiles above are compute-bound, and at 16 rows x K = 1024 the rows (64 KB) no longer
// fit L1: each tile's 4 row loads come from L2 beside its 3 weight loads, and the horizontal sums follow. Here 16
// weight rows at a time are transposed into a panel [K][16] (64 KB at K = 1024: L2) and meet up to 6 rows at a time
// in 6 x 16 register tiles, one broadcast row value against two panel vectors (12 accumulators, no horizontal
// sums). While a panel is in use the next 16 weight rows are prefetched, a cache line every few steps spread over
// all its passes, so the weight stream overlaps the FMAs instead of alternating with them. 2-core Zen 3 VM
// (2026-12), the `mid` model's 16-row linears (7 layers' attention projections and shared experts, the dense MLP
// and the head; weights out of cache), interleaved, best and median of 16: 12.9 / 13.7 against 14.5 / 15.1 ms
// (1.10-1.12x); 12 rows 1.04-1.06x, 32 rows 1.07-1.14x, 64 rows 0.97-1.01x; 8 rows and fewer no better (4 rows
// 0.8x), so those keep the tiles above. End to end on the `mid` model, the same engine with the form on and off in
// turns (8 rounds): a 16-sequence decode step 50.1 / 58.0 against 55.2 / 60.8 ms (best / median), a 256-token
// prefill 300 / 339 against 343 / 361 ms.
// DEEPINFER_CPU_PANEL=0 (or deepinfer_cpu::panel_form(False)) keeps the tiles above for every group.
constexpr int64_t kPanelMinRows = 12;
std::atomic<bool> g_allow_panel{[] {
  const char* v = std::getenv("DEEPINFER_CPU_PANEL");
  return v == nullptr || std::string(v) != "0";
}()};
constexpr int kPanelN = 16;     // weight rows a panel
constexpr int kPanelR = 6;      // rows a register tile

inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// panel[k * 16 + j] = w[j, k] for the first `rows` (<= 16) weight rows (row stride K), zero past them; K % 8 == 0.
template <typename W>
void pack_panel(const W* w, int64_t K, int rows, float* panel) {
  for (int half = 0; half < 2; ++half) {
    const W* src[8];
    for (int i = 0; i < 8; ++i) src[i] = half * 8 + i < rows ? w + (half * 8 + i) * K : nullptr;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = src[i] ? wload(src[i] + k) : _mm256_setzero_ps();
      transpose8(r);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) _mm256_store_ps(panel + (k + c) * kPanelN + half * 8, r[c]);
    }
  }
}

// out[r * ldo + j] = sum_k x[r * K + k] panel[k][j] for R rows and the first `cols` columns; PF: a prefetch of
// the next cache line from `pf` every `every` steps while pf < pf_end.
template <int R, bool PF>
void panel_tile(const float* panel, const float* x, int64_t K, float* out, int64_t ldo, int cols,
                const char* pf, const char* pf_end, int every) {
  __m256 a0[R], a1[R];
  const float* xr[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    a0[r] = a1[r] = _mm256_setzero_ps();
    xr[r] = x + r * K;
  }
  int count = every;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 p0 = _mm256_load_ps(panel + k * kPanelN), p1 = _mm256_load_ps(panel + k * kPanelN + 8);
    if (PF && --count == 0) {
      count = every;
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr[r] + k);
      a0[r] = _mm256_fmadd_ps(p0, xb, a0[r]);
      a1[r] = _mm256_fmadd_ps(p1, xb, a1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if (cols == kPanelN) {
      _mm256_storeu_ps(out + r * ldo, a0[r]);
      _mm256_storeu_ps(out + r * ldo + 8, a1[r]);
    } else {
      alignas(32) float t[kPanelN];
      _mm256_store_ps(t, a0[r]);
      _mm256_store_ps(t + 8, a1[r]);
      for (int c = 0; c < cols; ++c) out[r * ldo + c] = t[c];
    }
  }
}

template <int R>
void panel_tile_pf(const float* panel, const float* x, int64_t K, float* out, int64_t ldo, int cols,
                   const char* pf, const char* pf_end, int every) {
  pf < pf_end ? panel_tile<R, true>(panel, x, K, out, ldo, cols, pf, pf_end, every)
              : panel_tile<R, false>(panel, x, K, out, ldo, cols, pf, pf_end, every);
}

void panel_rows(int R, const float* panel, const float* x, int64_t K, float* out, int64_t ldo, int cols,
                const char* pf, const char* pf_end, int every) {
  switch (R) {
    case 1: panel_tile_pf<1>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
    case 2: panel_tile_pf<2>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
    case 3: panel_tile_pf<3>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
    case 4: panel_tile_pf<4>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
    case 5: panel_tile_pf<5>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
    default: panel_tile_pf<6>(panel, x, K, out, ldo, cols, pf, pf_end, every); break;
  }
}

// Weight rows [n0, n1) of one group's weight w [N, K] against its `rows` rows x -> out (row stride N), 16 weight
// rows a panel; the rows split evenly into register tiles of at most 6.
template <typename W>
void panel_task(const W* w, const float* x, int64_t rows, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  thread_local std::vector<float> buf;
  if (buf.size() < size_t(K * kPanelN + 8)) buf.resize(K * kPanelN + 8);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t(31));
  const int64_t tiles = (rows + kPanelR - 1) / kPanelR;
  const int64_t next_bytes = kPanelN * K * int64_t(sizeof(W));
  for (int64_t n = n0; n < n1; n += kPanelN) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanelN, n1 - n));
    pack_panel(w + n * K, K, cols, panel);
    // The next 16 weight rows of this group (the next task's, past n1), spread over this panel's passes.
    const char* next = reinterpret_cast<const char*>(w + (n + kPanelN) * K);
    const char* end = reinterpret_cast<const char*>(w + std::min<int64_t>(N, n + 2 * kPanelN) * K);
    const int64_t lines = next_bytes / 64;
    const int every = static_cast<int>(std::max<int64_t>(1, K * tiles / std::max<int64_t>(1, lines)));
    int64_t r = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int R = static_cast<int>((rows - r + (tiles - t) - 1) / (tiles - t));
      const char* pf = next + (lines * t / tiles) * 64;
      const char* pf_end = std::min(end, next + (lines * (t + 1) / tiles) * 64);
      panel_rows(R, panel, x + r * K, K, out + r * N + n, N, cols, pf, pf_end, every);
      r += R;
    }
  }
}

// ---- groups of kXPanelMinRows..16 rows (AVX2; AVX-512 forms below): the rows transposed, the weights broadcast ----
//
// The panel form above transposes every 16 weight rows into a panel, a pass over the weights as long as the FMAs'
// at 16 rows. Here the group's rows are transposed instead, once per call: xt[k][16] (16 KB at K = 256, L1), zero
// past the group's rows, and each register tile takes NW weight rows, one broadcast weight value against the two xt
// vectors of its k (2 NW accumulators: out[0..15, n] for its NW columns n). The weights are read as they are stored;
// bf16 ones two values at a time (one 32-bit broadcast, then a shift and a mask make both; 4 weight rows a tile, as 6
// spilled). A 16-row decode bucket's linears are exactly this shape. 2-core Zen 3 VM, 16 rows, against the panel
// form (best of 9 interleaved): fp32 weights 1.03-1.09x on the demo model's 256-4096 x 256, 1.10-1.21x on the `mid`
// model's 1024-16384 x 1024 (one thread: 75 -> 85 GFLOP/s, MKL's 1024^3 sgemm 87-94); bf16 weights 1.0-1.07x and
// 1.0-1.12x. At 12 rows, a quarter of the lanes idle, it ran 0.8-0.97x: 14 rows and up only.
// DEEPINFER_CPU_XPANEL=0 (or deepinfer_cpu::xpanel_form(False)) leaves those groups to the panel form, and the
// AVX-512 forms' to their tiles.
constexpr int64_t kXPanelMinRows = 14;
constexpr int64_t kXPanelMaxRows = 16;    // the two 8-lane vectors of an xt row
std::atomic<bool> g_allow_xpanel{[] {
  const char* v = std::getenv("DEEPINFER_CPU_XPANEL");
  return v == nullptr || std::string(v) != "0";
}()};
std::atomic<uint64_t> g_call_id{0};   // each grouped_rows_typed call's id: a thread's xt is reused within one call only

template <typename W>
constexpr int xpanel_nw() { return std::is_same_v<W, float> ? 6 : 4; }

// This thread's transposed rows for one call's group (`key`), built at the first of its tasks on that group:
// [K][16] of T, 64-byte aligned, zero past the group's rows; `pack` fills it. Every x-panel form's (AVX2, AVX-512,
// bf16 dot products): keys are unique across calls, so they share the buffer.
template <typename T, typename Pack>
T* transposed_rows(int64_t K, uint64_t key, const Pack& pack) {
  thread_local std::vector<T> buf;
  thread_local uint64_t built = ~uint64_t(0);
  const size_t need = size_t(K + 1) * 16 + 64 / sizeof(T);
  if (buf.size() < need) {
    buf.resize(need);
    built = ~uint64_t(0);
  }
  T* xt = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  if (built != key) {
    pack(xt);
    built = key;
  }
  return xt;
}

// xt[k * 16 + r] = x[r * K + k] for r < rows (<= 16), zero for rows..15 (xt 32-byte aligned): 8 x 8 blocks
// transposed in registers (transpose8, as the panels'), the last K % 8 columns one value at a time. Every call of a
// 16-row product pays this once a thread (a 16-sequence decode step's linears): against the scalar loop it replaced,
// rows_linear at 16 rows (bf16 weights, 2 threads, 2-core AVX2 VM, 15 alternated rounds) 6.0 -> 4.6 us over 8
// weight rows of K = 256, 16.9 -> 15.6 over 176, 39.7 -> 35.8 over 256 of K = 512.
inline void pack_rows_t(const float* x, int64_t rows, int64_t K, float* xt) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = h * 8 + i < rows ? _mm256_loadu_ps(x + (h * 8 + i) * K + k) : _mm256_setzero_ps();
      transpose8(r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_store_ps(xt + (k + j) * 16 + h * 8, r[j]);
    }
  for (; k < K; ++k)
    for (int r = 0; r < 16; ++r) xt[k * 16 + r] = r < rows ? x[r * K + k] : 0.0f;
}

template <int NW, typename W>
void xpanel_tile(const W* w, const float* xt, int64_t K, float* out, int64_t ldo, int rows) {
  __m256 a0[NW], a1[NW];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  int64_t k = 0;
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (; k + 2 <= K; k += 2) {
      const float* p = xt + k * 16;
      const __m256 p0 = _mm256_load_ps(p), p1 = _mm256_load_ps(p + 8);
      const __m256 q0 = _mm256_load_ps(p + 16), q1 = _mm256_load_ps(p + 24);
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) {
        const __m256i v = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(w + i * K + k)));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                  // w[i, k]
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));               // w[i, k + 1]
        a0[i] = _mm256_fmadd_ps(lo, p0, a0[i]);
        a1[i] = _mm256_fmadd_ps(lo, p1, a1[i]);
        a0[i] = _mm256_fmadd_ps(hi, q0, a0[i]);
        a1[i] = _mm256_fmadd_ps(hi, q1, a1[i]);
      }
    }
  }
  for (; k < K; ++k) {
    const __m256 p0 = _mm256_load_ps(xt + k * 16), p1 = _mm256_load_ps(xt + k * 16 + 8);
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) {
      const __m256 b = _mm256_set1_ps(wscalar(w[i * K + k]));
      a0[i] = _mm256_fmadd_ps(b, p0, a0[i]);
      a1[i] = _mm256_fmadd_ps(b, p1, a1[i]);
    }
  }
  alignas(32) float t[NW][16];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i) {
    _mm256_store_ps(t[i], a0[i]);
    _mm256_store_ps(t[i] + 8, a1[i]);
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < NW; ++i) out[r * ldo + i] = t[i][r];
}

// Weight rows [n0, n1) of one group's weight w [N, K] against its `rows` (<= 16) rows x -> out (row stride N).
template <typename W>
void xpanel_task(const W* w, const float* x, int64_t rows, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo,
                 uint64_t key) {
  const float* xt = transposed_rows<float>(K, key, [&](float* t) { pack_rows_t(x, rows, K, t); });
  constexpr int NW = xpanel_nw<W>();
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) xpanel_tile<NW>(w + n * K, xt, K, out + n, ldo, static_cast<int>(rows));
  for (; n < n1; ++n) xpanel_tile<1>(w + n * K, xt, K, out + n, ldo, static_cast<int>(rows));
}

// The fp32-rows kernel over the groups -> out rows of the groups.
template <typename W>
void grouped_rows_typed(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = wt.size(0), N = wt.size(1);
  const float* xp = x.data_ptr<float>();
  const W* wp = wt.data_ptr<W>();
  float* outp = out.data_ptr<float>();
  const bool panel = K % 8 == 0 && g_allow_panel.load(std::memory_order_relaxed);
  const bool xpanel = g_allow_xpanel.load(std::memory_order_relaxed);
  const uint64_t call = g_call_id.fetch_add(1, std::memory_order_relaxed) * uint64_t(G + 1);
  for_each_task(M, G, N, ends, [&](int64_t g, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
    const W* w = wp + g * N * K;
    const float* xr = xp + r0 * K;
    float* o = outp + r0 * N;
    if (xpanel && r1 - r0 >= kXPanelMinRows && r1 - r0 <= kXPanelMaxRows)
      return xpanel_task(w, xr, r1 - r0, K, n0, n1, o, N, call + g);
    if (panel && r1 - r0 >= kPanelMinRows) return panel_task(w, xr, r1 - r0, K, N, n0, n1, o);
    int64_t n = n0;
    for (; n + kNW <= n1; n += kNW) weight_rows<kNW>(w + n * K, xr, r1 - r0, K, o + n, N);
    for (; n < n1; ++n) weight_rows<1>(w + n * K, xr, r1 - r0, K, o + n, N);
  });
}

// ---- the same kernel with AVX-512 (fp32 math): 16-lane vectors, tiles of 4 weight rows x 6 rows ----
//
// Taken where the CPU has AVX-512 (compiled function by function with a target attribute, like the bf16 kernel below,
// so the library still loads on AVX2-only CPUs; DEEPINFER_CPU_AVX512=0 or deepinfer_cpu::avx512_form keep the AVX2
// kernel). 32 registers hold twice the AVX2 tile's accumulators for the same loads, and every first pass over a weight
// prefetches it (one- and two-row passes over fp32 weights only under Zen4Tuning: prefetch_few_rows). On a 2-core Zen 4
// VM, against the AVX2 kernel (both with the work-balanced tasks of for_each_task): `mid` experts at 1024 rows over 16
// groups (a 256-token prefill chunk, compute-bound) 140-151 -> 164-176 GFLOP/s (K = 1024) and 137-167 -> 161-176 (K =
// 512), where one 1024 x 1024 x 1024 MKL sgemm runs 182-195; bf16 weights at 4-64 rows over 16 groups (decode, weights
// out of cache) 1.3-1.9x; fp32 weights at 4 rows 1.1-1.2x, 16-64 rows alike; the 16384 x 1024 head at one row 1.15x
// (fp32) and 1.5-1.9x (bf16), at 16 rows 1.15-1.2x. The one-row prefetch alone made bf16 weights at 4 rows over 16
// groups 0.40 -> 0.26 ms (31 GB/s), where the AVX2 kernel's measurements (T0 prefetch) had it cost 5-8%.
#define DEEPINFER_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

std::atomic<bool> g_allow_avx512{[] {
  const char* v = std::getenv("DEEPINFER_CPU_AVX512");
  return v == nullptr || std::string(v) != "0";
}()};

bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
}

bool use_avx512() { return cpu_has_avx512() && g_allow_avx512.load(std::memory_order_relaxed); }

// 4 x 6 accumulators + 4 weight vectors + 1 row vector of the 32 registers. (6 x 4 and 3 x 8 ran at 66 and 88
// GFLOP/s on the prefill shapes above: GCC spilled.)
constexpr int kNW5 = 4;   // weight rows per register tile
constexpr int kR5 = 6;    // activation rows per register tile

DEEPINFER_AVX512_TARGET inline __m512 wload512(const float* p) { return _mm512_loadu_ps(p); }
DEEPINFER_AVX512_TARGET inline __m512 wload512(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
DEEPINFER_AVX512_TARGET inline __m512 wload512_tail(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
DEEPINFER_AVX512_TARGET inline __m512 wload512_tail(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Sixteen-lane accumulators acc[0..NA) -> their horizontal sums in sums[0..NA) (halved to eight lanes, then the
// AVX2 hadd tree eight at a time).
template <int NA>
DEEPINFER_AVX512_TARGET inline void hsums512(const __m512* acc, float* sums) {
#pragma GCC unroll 4
  for (int c = 0; c < (NA + 7) / 8; ++c) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const int q = c * 8 + t;
      a[t] = q < NA ? _mm256_add_ps(_mm512_castps512_ps256(acc[q]), _mm512_extractf32x8_ps(acc[q], 1))
                    : _mm256_setzero_ps();
    }
    _mm256_store_ps(sums + 8 * c, deepinfer_simd::hsum8(a));
  }
}

// Per-microarchitecture choices of the AVX-512 forms, fixed at compile time in each instantiation and picked per call
// (cpu_tuning()): the cache level the weights' software prefetches fill (kHint), whether the bf16 dot-product tile's
// 3-5-row passes read their rows as memory operands (kFoldBf16, below), and whether one- and two-row passes prefetch
// (kPrefetchFewRows). Zen4Tuning is measured on Zen 4 and taken everywhere but Zen 5 (AMD family 26 and later: AVX-512
// on full-width units, two 512-bit FMAs or dot products a cycle). On a 2-core Zen 5 VM, weights out of cache in the
// runtime's huge-page arena, rounds interleaved with a plain AVX-512 read of the same weights, Zen5Tuning against
// Zen4Tuning: bf16 dot products 1.05-1.10x at 4 rows a group (the `mid` experts over 16 groups, uniform and as routed),
// 1.07-1.08x at 16 rows (1024 x 1024 and the 16384 x 1024 head), 1.10x at 64 (a prefill chunk's experts), 0.98-1.04x at
// 1-2 and 8; the fp32 form (T0 only: its fold stays) over bf16 weights 1.02-1.10x at 1-4 rows a group, 0.99-1.01x at
// 16-64 (in 4 KB pages the bf16 products' gains were 1.06-1.18x). End to end, decode steps alternating the two step by
// step: 1.007-1.011x. On Zen 4 the same T0 prefetch ran the experts 1.3-1.8x slower than T1 (kPrefetchBytes), and one-
// and two-row passes ran faster with a prefetch where Zen 5 ran them faster without (kPrefetchFewRows:
// prefetch_few_rows, tile_bf16). DEEPINFER_CPU_TUNING=zen4|zen5 (or deepinfer_cpu::tuning) overrides the choice; tests
// run both.
struct Zen4Tuning {
  static constexpr _mm_hint kHint = _MM_HINT_T1;
  static constexpr bool kFoldBf16 = true;
  static constexpr bool kPrefetchFewRows = true;
};
struct Zen5Tuning {
  static constexpr _mm_hint kHint = _MM_HINT_T0;
  static constexpr bool kFoldBf16 = false;
  static constexpr bool kPrefetchFewRows = false;
};

bool cpu_is_zen5_or_later() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;   // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
    const unsigned family = ((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
    return family >= 0x1a;
  }();
  return yes;
}

// A tuning's name -> 0 (auto: as the CPU), 4 or 5 (forced); -1 for any other name.
int tuning_code(const std::string& t) { return t == "auto" ? 0 : t == "zen4" ? 4 : t == "zen5" ? 5 : -1; }

// Read as the library loads, where an exception would end the process: an unknown value counts as auto
// (runtime/cpu_kernels.py warns of it).
std::atomic<int> g_tuning{[] {
  const char* v = std::getenv("DEEPINFER_CPU_TUNING");
  return v == nullptr ? 0 : std::max(tuning_code(v), 0);
}()};

bool zen5_tuning() {
  const int t = g_tuning.load(std::memory_order_relaxed);
  return t == 5 || (t == 0 && cpu_is_zen5_or_later());
}

// f(Zen5Tuning{}) or f(Zen4Tuning{}), as this call's tuning is.
template <typename F>
void with_tuning(const F& f) {
  zen5_tuning() ? f(Zen5Tuning{}) : f(Zen4Tuning{});
}

// The first pass of a tile of 3-5 rows over fp32 weights (decode steps' experts, a few rows a group) reads each row's
// vector once per FMA, as the FMA's memory operand, instead of once into a register shared by its four FMAs, and a
// group of 6-11 rows makes its pass from memory such a 5-row tile. More loads, yet on a 2-core Zen 4 VM (weights out of
// cache in huge pages as the runtime's arena, rounds interleaved with torch's sum() of the same weights) the `mid`
// experts over 16 groups ran 1.07-1.33x faster at 4 rows a group (gate-up 33-37 -> 41-50 GB/s where sum() read 51-62),
// 1.06-1.31x at 5, 1.02-1.2x at 6-10, 1.01-1.07x at 3; 1-2 and 12+ rows, later passes and every compute-bound shape
// 0.99-1.01x, so those keep the register (a folded 6-row pass: 0.6-0.8x), as do bf16 weights (widened in registers:
// compute-bound at 4 rows, 0.84-0.87x folded). The bf16 dot-product tile folds 3-5 rows too (1.05-1.23x at 4 and 5
// rows; its 6-11-row groups gained nothing from a 5-row lead), on every pass of 3-5 rows (tile_bf16), under Zen4Tuning
// (Zen5Tuning does not fold). GCC's znver3 tuning makes this choice itself for such tiles (its other choices cost the
// compute-bound tiles 11-25%); the empty asm makes it under the generic tuning the kernels are built with. Same
// instructions on the same operands: the sums are bit for bit.
template <int R>
constexpr bool kFoldRows = R >= 3 && R <= 5;

// One- and two-row tiles prefetch on their pass from memory where the weights are widened in registers (bf16
// weights, fp32 rows): there the loop has work between its loads. Over fp32 weights, and in the bf16 dot-product tile,
// the loop is little but loads: on Zen 5 the hardware prefetchers keep it fed and the software prefetch only competes
// with them for the load queue, so under Zen5Tuning those passes go without. On a 2-core Zen 5 VM (family 26:
// AVX-512 with full-width units), weights out of cache, rounds interleaved with a plain AVX-512 read of the same
// weights: without it, fp32 weights at one row 1.17-1.23x faster (the 16384 x 1024 head 0.69 -> 0.85 of the plain
// read's rate, 16 one-row groups of 1024 x 1024 0.86 -> 1.01), bf16 dot products at one row 1.14-1.22x
// (0.80-0.88 -> 0.91-1.05), at two rows 0.99-1.09x; widened bf16 weights at one row 0.96-1.02x (so they keep it: on
// Zen 4 it made them 1.5x faster). The AVX2 kernel's one-row fp32 tiles went without it already (Zen 3: it cost
// them 5-15%). On Zen 4 those passes fall short of the plain read without it: a 2-core Zen 4 VM, weights out of cache
// in huge pages, processes alternated (torch's sum() of the same 268 MB reading 35-38 GB/s): with it, fp32 weights at
// one row 1.06-1.35x (the 65536 x 1024 weight 0.75-0.94 -> 0.96-1.02 of sum()'s rate), two rows 1.03-1.16x, 64 one-
// and two-row groups of 1024 x 1024 1.0-1.07x.
template <typename Tune, typename W>
constexpr bool prefetch_few_rows = !std::is_same_v<W, float> || Tune::kPrefetchFewRows;

template <typename Tune, int NW, int R, bool PF, typename W>
DEEPINFER_AVX512_TARGET inline void tile512(const W* w, const float* x, int64_t ldx, int64_t K, float* out, int64_t ldo) {
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(W), kStep = 64 / sizeof(W);
  __m512 acc[NW * R];
#pragma GCC unroll 24
  for (int t = 0; t < NW * R; ++t) acc[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) wv[i] = wload512(w + i * K + k);
    if (PF && (k & (kStep - 1)) == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + kAhead), Tune::kHint);
    }
    if constexpr (PF && std::is_same_v<W, float> && kFoldRows<R>) {
#pragma GCC unroll 4
      for (int j = 0; j < R; ++j) {
        const float* xj = x + j * ldx + k;
#pragma GCC unroll 4
        for (int i = 0; i < NW; ++i) {
          asm("" : "+r"(xj));                // a fresh load each time: folded into the FMA as its memory operand
          acc[i * R + j] = _mm512_fmadd_ps(wv[i], _mm512_loadu_ps(xj), acc[i * R + j]);
        }
      }
    } else {
#pragma GCC unroll 6
      for (int j = 0; j < R; ++j) {
        const __m512 xv = _mm512_loadu_ps(x + j * ldx + k);
#pragma GCC unroll 4
        for (int i = 0; i < NW; ++i) acc[i * R + j] = _mm512_fmadd_ps(wv[i], xv, acc[i * R + j]);
      }
    }
  }
  if (k < K) {                               // the tail, masked (zeros add nothing)
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) wv[i] = wload512_tail(w + i * K + k, m);
#pragma GCC unroll 6
    for (int j = 0; j < R; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + j * ldx + k);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) acc[i * R + j] = _mm512_fmadd_ps(wv[i], xv, acc[i * R + j]);
    }
  }
  alignas(32) float sums[(NW * R + 7) / 8 * 8];
  hsums512<NW * R>(acc, sums);
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < R; ++j) out[j * ldo + i] = sums[i * R + j];
}

// A tile of R rows that prefetches (the pass from memory) or not.
template <typename Tune, int NW, int R, typename W>
DEEPINFER_AVX512_TARGET inline void pass512(bool pf, const W* w, const float* x, int64_t ldx, int64_t K, float* out,
                                            int64_t ldo) {
  pf ? tile512<Tune, NW, R, true>(w, x, ldx, K, out, ldo) : tile512<Tune, NW, R, false>(w, x, ldx, K, out, ldo);
}

template <typename Tune, int NW, typename W>
DEEPINFER_AVX512_TARGET inline void weight_rows512(const W* w, const float* x, int64_t ldx, int64_t rows, int64_t K,
                                                   float* out, int64_t ldo) {
  int64_t r = 0;
  if (rows >= kR5) {
    if (std::is_same_v<W, float> && rows < 2 * kR5) {   // 6-11 rows: the pass from memory takes 5 of them, folded
      tile512<Tune, NW, 5, true>(w, x, ldx, K, out, ldo);
      r = 5;
    } else {
      tile512<Tune, NW, kR5, true>(w, x, ldx, K, out, ldo);
      r = kR5;
    }
    for (; r + kR5 <= rows; r += kR5) tile512<Tune, NW, kR5, false>(w, x + r * ldx, ldx, K, out + r * ldo, ldo);
  }
  const bool first = r == 0;
  const float* xr = x + r * ldx;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 5: pass512<Tune, NW, 5>(first, w, xr, ldx, K, o, ldo); break;
    case 4: pass512<Tune, NW, 4>(first, w, xr, ldx, K, o, ldo); break;
    case 3: pass512<Tune, NW, 3>(first, w, xr, ldx, K, o, ldo); break;
    case 2: pass512<Tune, NW, 2>(first && prefetch_few_rows<Tune, W>, w, xr, ldx, K, o, ldo); break;
    case 1: pass512<Tune, NW, 1>(first && prefetch_few_rows<Tune, W>, w, xr, ldx, K, o, ldo); break;
    default: break;
  }
}

// Weight rows [n0, n1) against `rows` rows, in blocks of `row_block` rows: a block's rows and the task's weight rows
// stay in L2 while they meet (the weights come from memory for the first block only).
template <typename Tune, typename W>
DEEPINFER_AVX512_TARGET void task512(const W* w, const float* x, int64_t ldx, int64_t rows, int64_t row_block, int64_t K,
                                     int64_t n0, int64_t n1, float* o, int64_t N) {
  for (int64_t r = 0; r < rows; r += row_block) {
    const int64_t nr = std::min(row_block, rows - r);
    const float* xr = x + r * ldx;
    float* orow = o + r * N;
    int64_t n = n0;
    for (; n + kNW5 <= n1; n += kNW5) weight_rows512<Tune, kNW5>(w + n * K, xr, ldx, nr, K, orow + n, N);
    for (; n < n1; ++n) weight_rows512<Tune, 1>(w + n * K, xr, ldx, nr, K, orow + n, N);
  }
}

// Groups of kXPanelMinRows..16 rows over fp32 weights (a 16-row decode bucket's linears and shared experts): the
// group's rows transposed once per call, xt[k] one 16-lane vector (row r in lane r, zero past the group's rows), each
// weight value broadcast from memory into its FMA (4 weight rows a tile: out[0..15, n] for its 4 columns n, no
// horizontal sums), in two k phases (8 independent chains: a core with two 512-bit FMA pipes keeps them both busy),
// the next tile's weight rows prefetched as this one streams. The tiles above make three passes over the weights at
// 16 rows (6 + 6 + 4), the first from memory: here one pass, 5 loads to 4 FMAs, so the weights' stream and the FMAs
// overlap. 2-core Zen 4 VM, 16 rows, weights out of cache (8 copies in turn), best of 3 interleaved rounds: the `mid`
// model's 672-16384 x 1024 and 1024 x 2816 1.16-1.37x (the 16384 x 1024 head 143 -> 194 GFLOP/s), 1024 x 512 and
// the demo model's 768-4096 x 256-384 1.03-1.04x; at 14 rows 1.11-1.29x and 0.96-0.97x. 8 weight rows a tile ran as
// fast at most shapes but at K = 2304, 2816 and 3072 at 0.85x of the tiles above (and 12 or 16 weight rows at
// 0.6-0.8x everywhere): the tile's concurrent weight streams, each a row 9-12 KB from the next, outrun what the core
// tracks. bf16 weights keep the tiles above: widening each broadcast pair (a shift and a mask per two FMAs) ran them
// at 0.8-0.9x. Each row's sum runs in its own lane in k order, so a row's bits do not depend on the group's other rows
// (but differ from the tiles': these groups sum in another order). End to end, one process, the forms on and off
// in turns (4-6 rounds): 16-sequence decode on `mid` 411 -> 444 tok/s; with bf16 products (the dot-product form
// below) `mid-bf16` 832 -> 886, the demo model 9976 -> 11240; bf16 activations on `mid-bf16` 838 -> 843. (bf16
// checkpoints under fp32 math, the demo model's default, have bf16 weights: they keep the tiles.)
// DEEPINFER_CPU_XPANEL=0 or deepinfer_cpu::xpanel_form(False) keeps the tiles for them.
template <typename Tune, int NW, bool PF>
DEEPINFER_AVX512_TARGET inline void xtile512(const float* w, const float* xt, int64_t K, float* out, int64_t ldo,
                                             int64_t rows) {
  __m512 a[NW], b[NW];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i) a[i] = b[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (PF && (k & 15) == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (NW + i) * K + k), Tune::kHint);
    }
    const __m512 x0 = _mm512_load_ps(xt + k * 16), x1 = _mm512_load_ps(xt + k * 16 + 16);
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * K + k]), x0, a[i]);
      b[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * K + k + 1]), x1, b[i]);
    }
  }
  if (k < K) {
    const __m512 x0 = _mm512_load_ps(xt + k * 16);
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * K + k]), x0, a[i]);
  }
  alignas(64) float t[NW][16];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i) _mm512_store_ps(t[i], _mm512_add_ps(a[i], b[i]));
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < NW; ++i) out[r * ldo + i] = t[i][r];
}

// dst[u * 16 + r] = src[r * ld + u] for 32-bit units u < units and rows r < 16 (zero for r >= rows): 16 x 16
// blocks transposed in registers (the standard unpack / shuffle / 128-bit-lane shuffle network), the last
// units % 16 one at a time. Pure moves: bf16 pairs pass through as they are. 1024 fp32 units of 16 rows: ~1 us,
// where the element-by-element loop took ~10.
DEEPINFER_AVX512_TARGET inline void transpose_rows32(const float* src, int64_t ld, int64_t rows, int64_t units,
                                                     float* dst) {
  int64_t u = 0;
  for (; u + 16 <= units; u += 16) {
    __m512 r[16], t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * ld + u) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {            // r[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
        t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
      }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {            // -> r[m]: column m of all 16 rows
      _mm512_store_ps(dst + (u + j) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
      _mm512_store_ps(dst + (u + j + 8) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD));
    }
  }
  for (; u < units; ++u)
    for (int64_t i = 0; i < 16; ++i) dst[u * 16 + i] = i < rows ? src[i * ld + u] : 0.0f;
}

// Weight rows [n0, n1) of one group's fp32 weight w [N, K] against its `rows` (14-16) rows x (row stride ldx).
template <typename Tune>
DEEPINFER_AVX512_TARGET void xpanel512_task(const float* w, const float* x, int64_t ldx, int64_t rows, int64_t K,
                                            int64_t n0, int64_t n1, float* out, int64_t ldo, uint64_t key) {
  const float* xt = transposed_rows<float>(K, key, [&](float* t) { transpose_rows32(x, ldx, rows, K, t); });
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) xtile512<Tune, 4, true>(w + n * K, xt, K, out + n, ldo, rows);
  for (; n < n1; ++n) xtile512<Tune, 1, false>(w + n * K, xt, K, out + n, ldo, rows);   // the last 1-3 weight rows
}

// Blocking for L2 (1 MB a core on Zen 4, 2 MB on recent Xeons): a task's weight rows ~256 KB, a row block ~384 KB.
constexpr int64_t kTaskWeightBytes = 256 << 10, kRowBlockBytes = 384 << 10;

template <typename W>
void grouped_rows_typed512(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = wt.size(0), N = wt.size(1);
  // Rows a multiple of 4 KB long put all of a tile's rows at the same offset in their 4 KB pages, so in one set
  // of the 8-way L1 (64 sets of 64 bytes): its 4 weight rows and 6 rows compete for 8 ways at every step. The
  // rows go to a copy with a stride one cache line longer (the weights stay as they are: the graphs read them
  // too). 2-core Zen 4 VM, interleaved: 256 rows x [5632, 1024] 0.915x the time (median of 12), the `mid`
  // experts at 1024 rows over 16 groups 0.944x, 16 rows x the 16384 x 1024 head 0.93-1.01x.
  const bool pad = (K * 4) % 4096 == 0;
  const int64_t ldx = pad ? K + 16 : K;
  at::Tensor xpad = pad ? at::empty({M, ldx}, x.options()) : x;
  if (pad) xpad.narrow(1, 0, K).copy_(x);
  const float* xp = xpad.data_ptr<float>();
  const W* wp = wt.data_ptr<W>();
  float* outp = out.data_ptr<float>();
  const int64_t block_n = std::clamp<int64_t>(kTaskWeightBytes / (K * int64_t(sizeof(W))) / kNW5 * kNW5, kNW5, kBlockN);
  const int64_t row_block = std::clamp<int64_t>(kRowBlockBytes / (K * 4) / kR5 * kR5, kR5, 16 * kR5);
  const bool xpanel = std::is_same_v<W, float> && g_allow_xpanel.load(std::memory_order_relaxed);
  const uint64_t call = g_call_id.fetch_add(1, std::memory_order_relaxed) * uint64_t(G + 1);
  with_tuning([&](auto tune) {
    for_each_task(M, G, N, ends, [&](int64_t g, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
      if constexpr (std::is_same_v<W, float>) {
        if (xpanel && r1 - r0 >= kXPanelMinRows && r1 - r0 <= kXPanelMaxRows)
          return xpanel512_task<decltype(tune)>(wp + g * N * K, xp + r0 * ldx, ldx, r1 - r0, K, n0, n1,
                                                outp + r0 * N, N, call + g);
      }
      task512<decltype(tune)>(wp + g * N * K, xp + r0 * ldx, ldx, r1 - r0, row_block, K, n0, n1, outp + r0 * N, N);
    }, block_n);
  });
}

// x fp32 [M, K], wt [G, N, K] fp32 or bf16, both contiguous.
void grouped_rows(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends, at::Tensor& out) {
  const bool bf16 = wt.scalar_type() == at::kBFloat16;
  if (use_avx512())
    bf16 ? grouped_rows_typed512<at::BFloat16>(x, wt, ends, out) : grouped_rows_typed512<float>(x, wt, ends, out);
  else
    bf16 ? grouped_rows_typed<at::BFloat16>(x, wt, ends, out) : grouped_rows_typed<float>(x, wt, ends, out);
}

// ---- bf16 rows x bf16 weights with AVX512-BF16 dot products (--matmul-dtype bfloat16) ----
//
// VDPBF16PS multiplies 32 bf16 pairs into 16 fp32 sums in one instruction: twice the FMAs of an fp32 FMA per
// instruction, so products over a few rows, compute-bound in fp32 from ~8 rows up, run up to twice as fast.
// Compiled for that ISA function by function (target attribute) and taken only where the CPU has it, so the
// library still loads on AVX2-only machines.
#define DEEPINFER_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

bool cpu_has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

constexpr int kNWb = 4;   // weight rows per register tile (4 x 6 accumulators + 4 + 1 of 32 zmm, as the AVX-512 form)
constexpr int kRb = 6;    // rows per register tile

// Every pass of 3+ rows over the weights prefetches kPrefetchBytes ahead of each weight row it reads, later passes (in
// L1) as well as the first (from memory); passes of 1-2 rows only under Zen4Tuning (kPrefetchFewRows). On a 2-core Zen
// 4 VM (weights out of cache in huge pages, processes alternated with and without, torch's sum() of the same bytes
// reading 33-37 GB/s), their prefetch made the 16384 x 1024 head's one-row pass 26-27 -> 30-39 GB/s and two-row 24 ->
// 33-45, 64 experts of 1024 x 1024 at one and two rows a group 23-27 -> 30-41 and 21-25 -> 35-49 GB/s: without it the
// loop, little but loads, reached only 0.7-0.8 of the fp32 form's prefetched reads of the same weights (end to end,
// `mid-bf16` with bf16 products at batch 1, four process pairs: 6.96-7.46 -> 6.89-7.62 ms a step, within this VM's
// noise); on Zen 5 they ran 1.14-1.22x faster without it at one row (tile512's notes). On a 2-core Zen 5 VM (weights
// out of cache, interleaved with a plain read of the same weights), prefetching in the later passes too made 16-row
// linears 1.07-1.27x faster (the 16384 x 1024 head 483-516 -> 551-655 GFLOP/s, 1024 x 1024 1.07-1.16x), every other
// shape 0.97-1.05x: the first pass alone issues its prefetches in a burst while it waits on memory, and the passes
// after it, compute-bound, then leave the memory bus idle.
template <typename Tune, int NW, int R>
DEEPINFER_BF16_TARGET inline void tile_bf16(const uint16_t* w, const uint16_t* x, int64_t K, float* out,
                                            int64_t ldo) {
  constexpr int64_t kAhead = kPrefetchBytes / 2;
  constexpr bool PF = R > 2 || Tune::kPrefetchFewRows;
  __m512 acc[NW][R];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < R; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {             // 32 bf16 (one 64-byte line) per row and step
    __m512i wv[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) wv[i] = _mm512_loadu_si512(w + i * K + k);
    if constexpr (PF) {
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + kAhead), Tune::kHint);
    }
    if constexpr (PF && Tune::kFoldBf16 && kFoldRows<R>) {
#pragma GCC unroll 4
      for (int j = 0; j < R; ++j) {
        const uint16_t* xj = x + j * K + k;
#pragma GCC unroll 4
        for (int i = 0; i < NW; ++i) {
          asm("" : "+r"(xj));                // as tile512's kFoldRows: the row as the instruction's memory operand
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)_mm512_loadu_si512(xj));
        }
      }
    } else {
#pragma GCC unroll 6
      for (int j = 0; j < R; ++j) {
        const __m512i xv = _mm512_loadu_si512(x + j * K + k);
#pragma GCC unroll 4
        for (int i = 0; i < NW; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
      }
    }
  }
  if (k < K) {                               // the tail, masked (zeros add nothing)
    const __mmask32 m = (__mmask32(1) << (K - k)) - 1;
    __m512i wv[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) wv[i] = _mm512_maskz_loadu_epi16(m, w + i * K + k);
#pragma GCC unroll 6
    for (int j = 0; j < R; ++j) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m, x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
    }
  }
  alignas(32) float sums[(NW * R + 7) / 8 * 8];
  hsums512<NW * R>(&acc[0][0], sums);
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < R; ++j) out[j * ldo + i] = sums[i * R + j];
}

template <typename Tune, int NW>
DEEPINFER_BF16_TARGET inline void weight_rows_bf16(const uint16_t* w, const uint16_t* x, int64_t rows, int64_t K,
                                                   float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + kRb <= rows; r += kRb) tile_bf16<Tune, NW, kRb>(w, x + r * K, K, out + r * ldo, ldo);
  const uint16_t* xr = x + r * K;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 5: tile_bf16<Tune, NW, 5>(w, xr, K, o, ldo); break;
    case 4: tile_bf16<Tune, NW, 4>(w, xr, K, o, ldo); break;
    case 3: tile_bf16<Tune, NW, 3>(w, xr, K, o, ldo); break;
    case 2: tile_bf16<Tune, NW, 2>(w, xr, K, o, ldo); break;
    case 1: tile_bf16<Tune, NW, 1>(w, xr, K, o, ldo); break;
    default: break;
  }
}

// One parallel task: weight rows [n0, n1) of group g against the group's rows, in L2-sized row blocks (as task512).
template <typename Tune>
DEEPINFER_BF16_TARGET void bf16_task(const uint16_t* w, const uint16_t* x, int64_t rows, int64_t row_block,
                                     int64_t K, int64_t n0, int64_t n1, float* o, int64_t N) {
  for (int64_t r = 0; r < rows; r += row_block) {
    const int64_t nr = std::min(row_block, rows - r);
    const uint16_t* xr = x + r * K;
    float* orow = o + r * N;
    int64_t n = n0;
    for (; n + kNWb <= n1; n += kNWb) weight_rows_bf16<Tune, kNWb>(w + n * K, xr, nr, K, orow + n, N);
    for (; n < n1; ++n) weight_rows_bf16<Tune, 1>(w + n * K, xr, nr, K, orow + n, N);
  }
}

// (p[0], p[1]) in every 32-bit lane.
DEEPINFER_BF16_TARGET inline __m512bh bf16_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Groups of kXPanelMinRows..16 rows, K even: the x-panel form of the fp32 kernel (above) with dot products. The
// group's rows transposed once per call into pairs, xt[p] one 512-bit vector of (x[r, 2p], x[r, 2p + 1]) for the 16
// rows r, and each weight pair (w[n, 2p], w[n, 2p + 1]) broadcast from memory into a VDPBF16PS: 4 weight rows a tile,
// two pair phases, the next tile's rows prefetched. One pass over the weights instead of three; 2-core Zen 4 VM, 16
// rows, weights out of cache, best of 3 interleaved rounds: the `mid` model's 672-16384 x 1024 1.06-1.09x (the head
// 335 -> 364 GFLOP/s), 1024 x 2816 1.29x, the demo model's 1024-4096 x 256 1.03-1.06x. Odd K (the last pair would
// reach past the row's end) keeps the tiles.
template <typename Tune, int NW, bool PF>
DEEPINFER_BF16_TARGET inline void xtile_bf16(const uint16_t* w, const uint16_t* xt, int64_t K, float* out, int64_t ldo,
                                             int64_t rows) {
  __m512 a[NW], b[NW];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i) a[i] = b[i] = _mm512_setzero_ps();
  auto pair = [&](int i, int64_t k) { return bf16_pair(w + i * K + k); };
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    if (PF && (k & 31) == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (NW + i) * K + k), Tune::kHint);
    }
    const __m512bh x0 = (__m512bh)_mm512_load_si512(xt + k * 16), x1 = (__m512bh)_mm512_load_si512(xt + k * 16 + 32);
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], x0, pair(i, k));
      b[i] = _mm512_dpbf16_ps(b[i], x1, pair(i, k + 2));
    }
  }
  if (k < K) {
    const __m512bh x0 = (__m512bh)_mm512_load_si512(xt + k * 16);
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) a[i] = _mm512_dpbf16_ps(a[i], x0, pair(i, k));
  }
  alignas(64) float t[NW][16];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i) _mm512_store_ps(t[i], _mm512_add_ps(a[i], b[i]));
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < NW; ++i) out[r * ldo + i] = t[i][r];
}

// Weight rows [n0, n1) of one group's weight w [N, K] (K even) against its `rows` (14-16) rows x.
template <typename Tune>
DEEPINFER_BF16_TARGET void xpanel_bf16_task(const uint16_t* w, const uint16_t* x, int64_t rows, int64_t K, int64_t n0,
                                            int64_t n1, float* out, int64_t ldo, uint64_t key) {
  // xt[(k / 2) * 32 + 2 r + (k % 2)] = x[r, k]: 16 rows x K values, as [K / 2][16][2]
  const uint16_t* xt = transposed_rows<uint16_t>(K, key, [&](uint16_t* t) {
    transpose_rows32(reinterpret_cast<const float*>(x), K / 2, rows, K / 2, reinterpret_cast<float*>(t));
  });
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) xtile_bf16<Tune, 4, true>(w + n * K, xt, K, out + n, ldo, rows);
  for (; n < n1; ++n) xtile_bf16<Tune, 1, false>(w + n * K, xt, K, out + n, ldo, rows);   // the last 1-3 weight rows
}

// Rows [r0, r1) x columns [n0, n1) of fp32 sums rounded to bf16 as torch rounds them (`narrow_bf16`), both row
// stride ld: a task's own block of the output, rounded while it is in this core's cache, instead of a parallel pass
// of its own over the whole output afterwards (`acc.to(kBFloat16)`) that read every block back from the core that
// wrote it. `mid-bf16` 16-sequence decode steps,
// the two forms alternated in one process (12 pairs of 32 steps, 2 threads, Zen 4): 1.004x with bf16 activations,
// 1.014x with bf16 products; batch 1 1.02x.
void round_block_bf16(const float* acc, at::BFloat16* out16, int64_t ld, int64_t r0, int64_t r1, int64_t n0,
                      int64_t n1) {
  for (int64_t r = r0; r < r1; ++r)
    deepinfer_simd::narrow_bf16(acc + r * ld + n0, reinterpret_cast<uint16_t*>(out16 + r * ld + n0), n1 - n0);
}

// x bf16 [M, K], wt bf16 [G, N, K], both contiguous -> out fp32 [M, N] (rows in no group left as they are); with
// out16 (bf16 [M, N], the same strides), each task's block rounded into it too.
void grouped_rows_bf16(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends, at::Tensor& out,
                       at::BFloat16* out16 = nullptr) {
  const int64_t M = x.size(0), K = x.size(1), G = wt.size(0), N = wt.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wt.data_ptr<at::BFloat16>());
  float* outp = out.data_ptr<float>();
  const int64_t block_n = std::clamp<int64_t>(kTaskWeightBytes / (K * 2) / kNWb * kNWb, kNWb, kBlockN);
  const int64_t row_block = std::clamp<int64_t>(kRowBlockBytes / (K * 2) / kRb * kRb, kRb, 16 * kRb);
  const bool xpanel = K % 2 == 0 && g_allow_xpanel.load(std::memory_order_relaxed);
  const uint64_t call = g_call_id.fetch_add(1, std::memory_order_relaxed) * uint64_t(G + 1);
  with_tuning([&](auto tune) {
    for_each_task(M, G, N, ends, [&](int64_t g, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
      if (xpanel && r1 - r0 >= kXPanelMinRows && r1 - r0 <= kXPanelMaxRows)
        xpanel_bf16_task<decltype(tune)>(wp + g * N * K, xp + r0 * K, r1 - r0, K, n0, n1, outp + r0 * N, N, call + g);
      else
        bf16_task<decltype(tune)>(wp + g * N * K, xp + r0 * K, r1 - r0, row_block, K, n0, n1, outp + r0 * N, N);
      if (out16 != nullptr) round_block_bf16(outp, out16, N, r0, r1, n0, n1);
    }, block_n);
  });
}

// bf16 rows and bf16 weights: the dot-product kernel where the CPU has it.
bool bf16_kernel_dtypes(const at::Tensor& x, const at::Tensor& w) {
  return x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot();
}

// The kernel's operands: fp32 rows, fp32 or bf16 weights.
bool kernel_dtypes(const at::Tensor& x, const at::Tensor& w) {
  return x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16);
}

void check_ends(const int64_t* ends, int64_t G, const char* op) {
  for (int64_t g = 1; g < G; ++g)
    TORCH_CHECK(ends[g - 1] <= ends[g], op, ": offs must be cumulative row ends (non-decreasing)");
}

// Rows [r1, M) belong to no group: zero them (the kernel writes every other row).
void zero_tail(at::Tensor& out, int64_t r1) {
  if (r1 < out.size(0)) out.narrow(0, r1, out.size(0) - r1).zero_();
}

// ---- AMX: groups of 16+ rows of bf16 products through oneDNN ----
//
// Where the CPU has AMX-BF16 (Sapphire Rapids and later Xeons), oneDNN's bf16 matmul runs on the tile units, far
// beyond what VDPBF16PS reaches once a group has rows to fill a tile. 2-core Xeon VM with AMX, weights out of
// cache: [16384, 1024] (the `mid` head) at 16 rows 2.09 ms against the kernel's 3.44, at 64 rows 3.1 against 12.7;
// [1024, 1024] (an expert's gate-up) at 64 rows 0.24 against 0.83 ms; at 4 rows oneDNN is slower (2.13 against
// 1.58 ms). So a call with a group of kAmxMinRows rows or more (prefill chunks, 16+ decode rows of one weight)
// takes oneDNN for its groups of that size and the kernel for the others; decode steps' experts (a few rows a
// group) stay in the kernel. Same operands and fp32 sums rounded to bf16 once either way; only the order of the
// sums differs. DEEPINFER_CPU_AMX=0 (or amx_form(False)) keeps the kernel everywhere.
constexpr int64_t kAmxMinRows = 16;

std::atomic<bool> g_allow_amx{[] {
  const char* v = std::getenv("DEEPINFER_CPU_AMX");
  return v == nullptr || std::string(v) != "0";
}()};

bool cpu_has_amx_bf16() {
  static const bool yes = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                          cpu_has_bf16_dot();
  return yes;
}

bool use_amx() { return cpu_has_amx_bf16() && g_allow_amx.load(std::memory_order_relaxed); }

// bf16 rows x [M, K] and weights wt [G, N, K] -> bf16 [M, N]: groups of kAmxMinRows+ rows one oneDNN matmul each
// (at::mm of bf16 operands: fp32 accumulation, one rounding), smaller ones the dot-product kernel, rows in no
// group zero.
at::Tensor amx_products(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends) {
  RECORD_FUNCTION("deepinfer_cpu::amx_products", std::vector<c10::IValue>());
  const int64_t M = x.size(0), G = wt.size(0), N = wt.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  int64_t r0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r1 = std::clamp<int64_t>(ends[g], r0, M);
    if (r1 - r0 >= kAmxMinRows) {
      at::Tensor o = out.narrow(0, r0, r1 - r0);
      at::mm_out(o, x.narrow(0, r0, r1 - r0), wt[g].t());
    } else if (r1 > r0) {
      at::Tensor acc = at::empty({r1 - r0, N}, x.options().dtype(at::kFloat));
      const int64_t one[1] = {r1 - r0};
      grouped_rows_bf16(x.narrow(0, r0, r1 - r0), wt[g].unsqueeze(0), one, acc);
      out.narrow(0, r0, r1 - r0).copy_(acc);
    }
    r0 = r1;
  }
  zero_tail(out, r0);
  return out;
}

// bf16 products (--matmul-dtype bfloat16) of bf16 rows x [M, K] and weights wt [G, N, K], both contiguous -> the
// groups' fp32 sums, rounded to bf16 once (rows in no group zero): the dot-product kernel, or without AVX512-BF16
// the fp32 kernel on the widened rows (exact products of the same bf16 operands); on AMX, amx_products when a group
// has kAmxMinRows rows or more.
at::Tensor bf16_products(const at::Tensor& x, const at::Tensor& wt, const int64_t* ends) {
  const int64_t M = x.size(0), G = wt.size(0), N = wt.size(1);
  const int64_t last = G ? std::clamp<int64_t>(ends[G - 1], 0, M) : 0;
  if (use_amx()) {
    bool big = false;
    for (int64_t g = 0, r0 = 0; g < G && !big; ++g) {
      const int64_t r1 = std::clamp<int64_t>(ends[g], r0, M);
      big = r1 - r0 >= kAmxMinRows;
      r0 = r1;
    }
    if (big) return amx_products(x, wt, ends);
  }
  RECORD_FUNCTION("deepinfer_cpu::grouped_rows_mm", std::vector<c10::IValue>());
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (cpu_has_bf16_dot()) {      // each task rounds its own block
    at::Tensor out = at::empty({M, N}, x.options());
    grouped_rows_bf16(x, wt, ends, acc, out.data_ptr<at::BFloat16>());
    zero_tail(out, last);
    return out;
  }
  grouped_rows(x.to(at::kFloat), wt, ends, acc);
  zero_tail(acc, last);
  return acc.to(at::kBFloat16);
}

at::Tensor grouped_rows_mm(const at::Tensor& x_, const at::Tensor& wt_, const at::Tensor& offs_) {
  TORCH_CHECK(x_.device().is_cpu() && wt_.device().is_cpu() && offs_.device().is_cpu(),
              "grouped_rows_mm: CPU tensors only");
  TORCH_CHECK(kernel_dtypes(x_, wt_) || bf16_kernel_dtypes(x_, wt_), "grouped_rows_mm: x fp32 with wt fp32 or "
              "bf16, or x and wt bf16 on a CPU with AVX512-BF16 (got ", x_.scalar_type(), ", ", wt_.scalar_type(), ")");
  TORCH_CHECK(x_.dim() == 2 && wt_.dim() == 3 && offs_.dim() == 1,
              "grouped_rows_mm: x [M, K], wt [G, N, K], offs [G]");
  const at::Tensor x = x_.contiguous(), wt = wt_.contiguous(), offs = offs_.to(at::kLong).contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = wt.size(0), N = wt.size(1);
  TORCH_CHECK(wt.size(2) == K, "grouped_rows_mm: x has K = ", K, ", wt has K = ", wt.size(2));
  TORCH_CHECK(offs.size(0) == G, "grouped_rows_mm: ", G, " groups but ", offs.size(0), " offsets");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int64_t* ends = offs.data_ptr<int64_t>();
  check_ends(ends, G, "grouped_rows_mm");
  if (x.scalar_type() == at::kBFloat16)
    grouped_rows_bf16(x, wt, ends, out);
  else
    grouped_rows(x, wt, ends, out);
  zero_tail(out, G ? std::clamp<int64_t>(ends[G - 1], 0, M) : 0);
  return out;   // fp32: the sums as the kernel made them
}

// ---- CPU implementations of the graphs' ops (runtime/ops.py defines them; these replace its Python bodies on
// CPU once this library is loaded, so an AOTInductor graph's call reaches C++ without entering Python) ----

// The same thresholds as runtime/ops.py's Python body (fixed here: once this library is loaded, changing the
// Python constants no longer changes the CPU path). The swap is decided per group here, on the average there.
constexpr int64_t kMaxRowsPerGroup = 64;     // ops.KERNEL_MAX_ROWS_PER_GROUP
constexpr int64_t kSwapMaxRows = 8;          // ops.SWAP_MAX_ROWS_PER_GROUP
constexpr int64_t kSwapMinWeight = 1 << 18;  // ops.SWAP_MIN_WEIGHT

// A weight in x's dtype (the torch paths' operand: bf16 weights with fp32 rows are widened first).
at::Tensor as_compute(const at::Tensor& w, const at::Tensor& x) {
  return w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type());
}

// deepinfer::grouped_mm: x [M, K], w [G, K, N] (a transposed view of the [G, N, K] expert weights), offs [G].
at::Tensor grouped_mm_cpu(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& offs_) {
  TORCH_CHECK(x_.dim() == 2 && w.dim() == 3 && offs_.dim() == 1, "grouped_mm: x [M, K], w [G, K, N], offs [G]");
  const int64_t M = x_.size(0), K = x_.size(1), G = w.size(0), N = w.size(2);
  TORCH_CHECK(w.size(1) == K, "grouped_mm: K mismatch ", K, " vs ", w.size(1));
  TORCH_CHECK(offs_.size(0) == G, "grouped_mm: one offset per group");
  const at::Tensor x = x_.contiguous(), offs = offs_.to(at::kLong).contiguous();
  const int64_t* ends = offs.data_ptr<int64_t>();
  check_ends(ends, G, "grouped_mm");
  const int64_t last = G ? std::clamp<int64_t>(ends[G - 1], 0, M) : 0;
  at::Tensor out = at::empty({M, N}, x.options());
  const bool few = last <= kMaxRowsPerGroup * G;    // the rows in groups: not padding, not other ranks' pairs
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    if (few) return bf16_products(x, w.transpose(1, 2).contiguous(), ends);
    // Without bf16 dot products torch's bf16 GEMMs run 3-4x under the fp32 path's rate (a 2-core AVX2 Zen 3 VM:
    // a `mid-bf16` prefill chunk 1.06 s against 0.34 s): the fp32 path on the widened rows instead (exact products
    // of the same operands, fp32 sums), rounded to bf16 once.
    if (!cpu_has_bf16_dot()) return grouped_mm_cpu(x.to(at::kFloat), w, offs_).to(at::kBFloat16);
  }
  // The AVX-512 form beats one MKL GEMM a group at any size (L2-blocked): `mid` experts at 128 and 256 rows a
  // group 1.16-1.36x; the AVX2 form only up to ~64 rows a group.
  if (kernel_dtypes(x, w) && (few || use_avx512())) {
    RECORD_FUNCTION("deepinfer_cpu::grouped_rows_mm", std::vector<c10::IValue>());
    grouped_rows(x, w.transpose(1, 2).contiguous(), ends, out);
  } else {
    // One GEMM per group, as torch's CPU _grouped_mm; a group of a few rows of a big weight with the operands
    // swapped (the few rows the narrow side: MKL streams the weight 1.5-3x faster that way).
    for (int64_t g = 0, r0 = 0; g < G; ++g) {
      const int64_t r1 = std::clamp<int64_t>(ends[g], r0, M);
      if (r1 > r0) {
        at::Tensor o = out.narrow(0, r0, r1 - r0);
        const at::Tensor xs = x.narrow(0, r0, r1 - r0), wg = as_compute(w[g], x);
        if (r1 - r0 <= kSwapMaxRows && K * N >= kSwapMinWeight)
          o.copy_(at::mm(wg.t(), xs.t()).t());
        else
          at::mm_out(o, xs, wg);
      }
      r0 = r1;
    }
  }
  zero_tail(out, last);
  return out;
}

// deepinfer::rows_linear: F.linear(x [M, K], w [N, K]) for a big weight: the kernel as one group for a few rows,
// and for any number of rows where its AVX-512 form runs (prefill chunks: 1.05-1.15x MKL's sgemm at 256 rows of
// the `mid` model's projections and MLP) or its AVX2 panel form does (K % 8 == 0: a 2-core Zen 3 VM, 65-512 rows
// of 256-2048 x 256-4096 weights, 1.0-1.3x MKL's sgemm over fp32 weights, 1.0-1.5x MKL after widening bf16 ones,
// which the kernel reads as they are); else MKL, the few rows as the narrow side.
at::Tensor rows_linear_cpu(const at::Tensor& x_, const at::Tensor& w_) {
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1), "rows_linear: x [M, K], w [N, K]");
  const bool few = x_.size(0) <= kMaxRowsPerGroup;
  if (x_.scalar_type() == at::kBFloat16 && w_.scalar_type() == at::kBFloat16) {    // bf16 products
    if (few) {
      const int64_t ends[1] = {x_.size(0)};
      return bf16_products(x_.contiguous(), w_.contiguous().unsqueeze(0), ends);
    }
    // oneDNN's bf16 GEMM where the CPU has bf16 dot products (AMX or AVX512-BF16); else the fp32 path on the
    // widened rows, rounded to bf16 once (as grouped_mm_cpu).
    if (cpu_has_bf16_dot()) return at::linear(x_, w_);
    return rows_linear_cpu(x_.to(at::kFloat), w_).to(at::kBFloat16);
  }
  const bool panel = x_.size(1) % 8 == 0 && g_allow_panel.load(std::memory_order_relaxed);
  if (!kernel_dtypes(x_, w_) || !(few || use_avx512() || panel)) {
    const at::Tensor w = as_compute(w_, x_);
    return few ? at::mm(w, x_.t()).t().contiguous() : at::linear(x_, w);
  }
  RECORD_FUNCTION("deepinfer_cpu::grouped_rows_mm", std::vector<c10::IValue>());
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  const int64_t ends[1] = {x.size(0)};
  grouped_rows(x, w.unsqueeze(0), ends, out);
  return out;
}

// deepinfer::head_linear: per head h, x[h] [T, K] times w[h] [N, K] transposed -> fp32 [H, T, N], the fp32 sums of
// the exact products (the decode attention's absorptions: the queries into the latent space, the latent output out
// of it). The heads are the kernel's groups: bf16 x and w take the dot-product kernel where the CPU has it (else the
// fp32 kernel on the widened rows: the same products), fp32 x the fp32 kernel on w as stored (fp32 or bf16). Also
// the CPU prefill's expansion of the latents to fp32 keys and values (one head of all heads' weights stacked).
// `mid` widths (8 heads, 16 rows, K 64 / 256, N 256 / 64; 2 threads, Zen 4): 19 / 16 us with bf16 rows, 40 / 37
// with fp32 rows, against 61 / 47 for torch's fp32 bmm of the rows and weights widened first.
at::Tensor head_linear_cpu(const at::Tensor& x_, const at::Tensor& w_) {
  TORCH_CHECK(x_.dim() == 3 && w_.dim() == 3 && x_.size(0) == w_.size(0) && x_.size(2) == w_.size(2),
              "head_linear: x [H, T, K], w [H, N, K] (got ", x_.sizes(), ", ", w_.sizes(), ")");
  const int64_t H = x_.size(0), T = x_.size(1), K = x_.size(2), N = w_.size(1);
  const bool dot = bf16_kernel_dtypes(x_, w_);
  const at::Tensor x = (dot ? x_ : x_.to(at::kFloat)).reshape({H * T, K}).contiguous();
  // Weights of another dtype, or many rows where only the kernel's dot-product tiles would take them (an AVX2 CPU
  // with the panel form off, as rows_linear_cpu): torch's fp32 bmm.
  const bool forms = T <= kMaxRowsPerGroup || use_avx512() || (K % 8 == 0 && g_allow_panel.load());
  if (!dot && !(kernel_dtypes(x, w_) && forms))
    return at::bmm(x.view({H, T, K}), w_.to(at::kFloat).transpose(1, 2));
  const at::Tensor w = w_.contiguous();
  std::vector<int64_t> ends(H);
  for (int64_t h = 0; h < H; ++h) ends[h] = (h + 1) * T;
  at::Tensor out = at::empty({H * T, N}, x.options().dtype(at::kFloat));
  RECORD_FUNCTION("deepinfer_cpu::grouped_rows_mm", std::vector<c10::IValue>());
  if (dot)
    grouped_rows_bf16(x, w, ends.data(), out);
  else
    grouped_rows(x, w, ends.data(), out);
  return out.view({H, T, N});
}

// deepinfer::bf16_einsum: a bf16 product of the prefill attention (--matmul-dtype bfloat16) as bf16 hardware computes
// it (exact products, fp32 sums, one rounding): torch's bf16 GEMM where the CPU has bf16 dot products, else the fp32
// GEMM on the widened operands (torch's bf16 GEMMs run 30-70x under the fp32 rate there; runtime/ops.py).
at::Tensor bf16_einsum_cpu(c10::string_view equation, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && !cpu_has_bf16_dot())
    return at::einsum(equation, {a.to(at::kFloat), b.to(at::kFloat)}).to(at::kBFloat16);
  return at::einsum(equation, {a, b});
}

// deepinfer_cpu::avx512_form(allow=None): whether the fp32 kernel takes its AVX-512 form (where the CPU has it;
// the default unless DEEPINFER_CPU_AVX512=0); with `allow`, first allow or forbid it. Tests run both forms.
bool avx512_form(std::optional<bool> allow) {
  if (allow.has_value()) g_allow_avx512.store(*allow);
  return use_avx512();
}

// deepinfer_cpu::tuning(set=None): which per-microarchitecture choices the AVX-512 forms take ("zen4" or "zen5";
// by default as the CPU, Zen5Tuning on AMD family 26 and later); with `set` ("zen4", "zen5" or "auto"), first choose.
std::string tuning(std::optional<std::string> set) {
  if (set.has_value()) {
    const int code = tuning_code(*set);
    TORCH_CHECK(code >= 0, "tuning: expected zen4, zen5 or auto, got ", *set);
    g_tuning.store(code);
  }
  return zen5_tuning() ? "zen5" : "zen4";
}

// deepinfer_cpu::panel_form(allow=None): whether the AVX2 kernel takes its panel form for groups of
// kPanelMinRows+ rows (the default unless DEEPINFER_CPU_PANEL=0); with `allow`, first allow or forbid it.
bool panel_form(std::optional<bool> allow) {
  if (allow.has_value()) g_allow_panel.store(*allow);
  return g_allow_panel.load();
}

// deepinfer_cpu::xpanel_form(allow=None): whether the AVX2 kernel takes its transposed-rows form for groups of
// kXPanelMinRows..16 rows (the default unless DEEPINFER_CPU_XPANEL=0); with `allow`, first allow or forbid it.
bool xpanel_form(std::optional<bool> allow) {
  if (allow.has_value()) g_allow_xpanel.store(*allow);
  return g_allow_xpanel.load();
}

// deepinfer_cpu::amx_form(allow=None): whether bf16 products of 16+ rows a group go to oneDNN on AMX (where the CPU
// has AMX-BF16; the default unless DEEPINFER_CPU_AMX=0); with `allow`, first allow or forbid it.
bool amx_form(std::optional<bool> allow) {
  if (allow.has_value()) g_allow_amx.store(*allow);
  return use_amx();
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("grouped_rows_mm(Tensor x, Tensor wt, Tensor offs) -> Tensor");
  m.def("avx512_form(bool? allow=None) -> bool", avx512_form);
  m.def("amx_form(bool? allow=None) -> bool", amx_form);
  m.def("panel_form(bool? allow=None) -> bool", panel_form);
  m.def("xpanel_form(bool? allow=None) -> bool", xpanel_form);
  m.def("tuning(str? set=None) -> str", tuning);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("grouped_rows_mm", grouped_rows_mm);
}


TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("grouped_mm", grouped_mm_cpu);
  m.impl("rows_linear", rows_linear_cpu);
  m.impl("bf16_einsum", bf16_einsum_cpu);
  m.impl("head_linear", head_linear_cpu);
}

// The AVX-512 path of paged_attention.cpp for prompt items: up to 16 new tokens x G heads of
// rows against every key before them, with the rows in the vector lanes.
//
// Why rows in lanes. The tile this replaces transposed each block of keys and then ran ONE row
// at a time: 16 scores by D broadcast-FMAs into 4 chains, a scalar max and a scalar exp per row,
// a horizontal sum, then the value rows added into that row alone, one dependent FMA after
// another: a low rate of multiply-adds for the vector units (measured on SmolLM2-135M's prompt:
// benchmarks/README.md, "Measurements behind the code's choices").
// Here a group of up to 48 rows is three zmm registers wide, so
//   - a score is q^T (transposed once per item) times a broadcast key element: every kT load of
//     the old tile becomes a scalar broadcast read straight from the pool (no transpose, no copy
//     of float32 rows), and 4 keys x 3 row vectors are 12 independent FMA chains;
//   - the running max, the rescale factor, the exponentials and the sums are all per lane:
//     vertical max and add, one vector exp for 16 rows, no horizontal reduction, no scalar exp;
//   - the value rows are added 4 output rows at a time (16 independent chains, each value
//     vector loaded once for the 4 rows), the probabilities broadcast from the lanes' store.
// The same calls run several times faster, on a float32 pool and on a bfloat16 one; decode items
// still take paged_attention_avx512.h. Tried: 8 keys a score pass (24 accumulators) was slower,
// 6 output rows a value pass no faster than 4 (measured: benchmarks/README.md).
//
// Online softmax as in the general loop, per chunk of at most 16 keys of one block: scores, the
// chunk's max, one rescale of the row's sum and output, exponentials, then the value rows. A key
// a row may not see (after its own position, before its window, past the chunk) gets score -inf
// by a lane select and probability exactly 0 by a zeroing mask, and on chunks that some rows see
// only in part its value row is added under a per-row mask, never multiplied by 0: a NaN in a
// slot the row may not see cannot reach its output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"

#if defined(__AVX512F__)
#define LLMOPT_ATTN_PROMPT 1

namespace llmopt::attn {

// One chunk's keys and values in float32, `stride` floats from one key's row to the next.
struct KeyRows {
  const float* k;
  const float* v;
  int64_t stride;
};

// Output rows r0..r0 + R (acc [R, D], row-major) rescaled by corr and given the chunk's value
// rows weighted by P [key][lane]. `bits` null: every row sees all n keys; else bits[i] has bit j
// set when row r0 + i sees key j, and the other FMAs are masked off (acc keeps its value).
template <int R, int NV, int W>
inline void add_values(float* acc, const float (*P)[W], const float* corr, int r0, const float* v, int64_t stride,
                       int64_t n, const uint32_t* bits) {
  __m512 a[R][NV];
  for (int i = 0; i < R; ++i) {
    const __m512 c = _mm512_set1_ps(corr[r0 + i]);
    for (int w = 0; w < NV; ++w) a[i][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * NV * 16 + 16 * w), c);
  }
  uint32_t any = 0;
  if (bits)
    for (int i = 0; i < R; ++i) any |= bits[i];
  for (int64_t j = 0; j < n; ++j) {
    if (bits && !((any >> j) & 1)) continue;
    const float* vr = v + j * stride;
    __m512 vv[NV];
    for (int w = 0; w < NV; ++w) vv[w] = _mm512_loadu_ps(vr + 16 * w);
    for (int i = 0; i < R; ++i) {
      const __m512 e = _mm512_set1_ps(P[j][r0 + i]);
      if (!bits) {
        for (int w = 0; w < NV; ++w) a[i][w] = _mm512_fmadd_ps(e, vv[w], a[i][w]);
      } else {
        const __mmask16 k = ((bits[i] >> j) & 1) ? 0xFFFF : 0;
        for (int w = 0; w < NV; ++w) a[i][w] = _mm512_mask3_fmadd_ps(e, vv[w], a[i][w], k);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < NV; ++w) _mm512_storeu_ps(acc + i * NV * 16 + 16 * w, a[i][w]);
}

// Rows q [rows, D] (rows <= 16 RV) over keys k0..k1 of one sequence and kv head; row r sees the
// positions lo[r] <= p < hi[r]. Leaves the running max m, sum l and unnormalized output acc
// [rows, D] as the general loop does. `fetch(p, n)` gives keys p..p + n (one block's) as KeyRows.
template <int RV, int NV, typename Fetch>
void prompt_group(const float* q, int64_t rows, const int32_t* lo, const int32_t* hi, int64_t k0, int64_t k1,
                  int64_t BS, float scale, Fetch fetch, float* m, float* l, float* acc) {
  constexpr int D = 16 * NV, W = 16 * RV, KB = 4;  // KB keys' scores per pass: KB x RV chains (8 keys spilled)
  const float ninf = -std::numeric_limits<float>::infinity();
  alignas(64) float qT[D][W];  // qT[d][r] = q[r][d], 0 past `rows`
  alignas(64) int32_t lo_l[W], hi_l[W];
  for (int r = 0; r < W; ++r) {
    for (int d = 0; d < D; ++d) qT[d][r] = r < rows ? q[r * D + d] : 0.0f;
    lo_l[r] = r < rows ? lo[r] : std::numeric_limits<int32_t>::max();  // padding lanes see nothing
    hi_l[r] = r < rows ? hi[r] : std::numeric_limits<int32_t>::min();
  }
  __m512i LO[RV], HI[RV];
  __m512 mv[RV], lv[RV];
  for (int g = 0; g < RV; ++g) {
    LO[g] = _mm512_load_si512(lo_l + 16 * g);
    HI[g] = _mm512_load_si512(hi_l + 16 * g);
    mv[g] = _mm512_set1_ps(ninf);
    lv[g] = _mm512_setzero_ps();
  }
  std::fill(acc, acc + rows * D, 0.0f);
  alignas(64) float P[16][W];    // scores, then probabilities: P[j][r], key j of the chunk, row r
  alignas(64) float corr[W];
  __mmask16 vis[16][RV];         // lanes that see key j
  for (int64_t p0 = k0; p0 < k1;) {
    const int64_t n = std::min({k1, (p0 / BS + 1) * BS, p0 + 16}) - p0;
    bool seen = false, full = true;  // some row sees some key; every row sees every key
    for (int g = 0; g < RV; ++g) {
      const __m512i first = _mm512_set1_epi32(int32_t(p0)), end = _mm512_set1_epi32(int32_t(p0 + n));
      const int64_t left = rows - 16 * g;  // rows in this vector's lanes
      const __mmask16 valid = left >= 16 ? 0xFFFF : left > 0 ? __mmask16((1u << left) - 1) : 0;
      seen |= (_mm512_cmplt_epi32_mask(LO[g], end) & _mm512_cmpgt_epi32_mask(HI[g], first)) != 0;
      full &= (_mm512_cmple_epi32_mask(LO[g], first) & _mm512_cmpge_epi32_mask(HI[g], end)) == valid;
    }
    if (!seen) { p0 += n; continue; }  // the whole group is past this chunk's keys (a window)
    const KeyRows kv = fetch(p0, n);
    __m512 mx[RV];
    for (int g = 0; g < RV; ++g) mx[g] = _mm512_set1_ps(ninf);
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
      const float* kr[KB];  // keys past n read key n - 1 (a slot the item owns) and are masked
      for (int k = 0; k < KB; ++k) kr[k] = kv.k + std::min<int64_t>(j0 + k, n - 1) * kv.stride;
      __m512 s[KB][RV];
      for (int k = 0; k < KB; ++k)
        for (int g = 0; g < RV; ++g) s[k][g] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        __m512 qv[RV];
        for (int g = 0; g < RV; ++g) qv[g] = _mm512_load_ps(&qT[d][16 * g]);
        for (int k = 0; k < KB; ++k) {
          const __m512 b = _mm512_set1_ps(kr[k][d]);
          for (int g = 0; g < RV; ++g) s[k][g] = _mm512_fmadd_ps(qv[g], b, s[k][g]);
        }
      }
      for (int k = 0; k < KB; ++k) {
        const int64_t j = j0 + k;
        const __m512i pos = _mm512_set1_epi32(int32_t(p0 + j));
        for (int g = 0; g < RV; ++g) {
          const __mmask16 see = j < n ? _mm512_cmple_epi32_mask(LO[g], pos) & _mm512_cmpgt_epi32_mask(HI[g], pos) : 0;
          vis[j][g] = see;
          const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), see, s[k][g], _mm512_set1_ps(scale));
          mx[g] = _mm512_max_ps(mx[g], x);
          _mm512_store_ps(&P[j][16 * g], x);
        }
      }
    }
    for (int g = 0; g < RV; ++g) {  // the online softmax, 16 rows a vector
      const __m512 mnew = _mm512_max_ps(mv[g], mx[g]);
      __m512 c = exp16(_mm512_sub_ps(mv[g], mnew));
      c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(mv[g], _mm512_set1_ps(ninf), _CMP_EQ_OQ), _mm512_setzero_ps());
      c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(mv[g], mnew, _CMP_EQ_OQ), _mm512_set1_ps(1.0f));  // as exp(0)
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(vis[j][g], exp16(_mm512_sub_ps(_mm512_load_ps(&P[j][16 * g]), mnew)));
        _mm512_store_ps(&P[j][16 * g], e);
        sum = _mm512_add_ps(sum, e);
      }
      lv[g] = _mm512_fmadd_ps(lv[g], c, sum);
      mv[g] = mnew;
      _mm512_store_ps(corr + 16 * g, c);
    }
    uint32_t bits[W];  // on a chunk some rows see in part: bit j of bits[r], row r sees key j
    if (!full)
      for (int r = 0; r < rows; ++r) {
        bits[r] = 0;
        for (int64_t j = 0; j < n; ++j) bits[r] |= uint32_t((vis[j][r / 16] >> (r % 16)) & 1) << j;
      }
    int r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
      add_values<4, NV, W>(acc + r0 * D, P, corr, r0, kv.v, kv.stride, n, full ? nullptr : bits + r0);
    for (; r0 < rows; ++r0)
      add_values<1, NV, W>(acc + r0 * D, P, corr, r0, kv.v, kv.stride, n, full ? nullptr : bits + r0);
    p0 += n;
  }
  alignas(64) float mo[W], lo_out[W];
  for (int g = 0; g < RV; ++g) {
    _mm512_store_ps(mo + 16 * g, mv[g]);
    _mm512_store_ps(lo_out + 16 * g, lv[g]);
  }
  std::copy(mo, mo + rows, m);
  std::copy(lo_out, lo_out + rows, l);
}

// All `rows` rows of an item, 48 at a time; false (nothing done) where D is not 32, 64 or 128.
template <typename Fetch>
bool prompt_item(const float* q, int64_t rows, int64_t D, const int32_t* lo, const int32_t* hi, int64_t k0,
                 int64_t k1, int64_t BS, float scale, Fetch fetch, float* m, float* l, float* acc) {
  if (D != 32 && D != 64 && D != 128) return false;
  for (int64_t r0 = 0; r0 < rows; r0 += 48) {
    const int64_t nr = std::min<int64_t>(48, rows - r0);
    const float* qr = q + r0 * D;
    float *mr = m + r0, *lr = l + r0, *ar = acc + r0 * D;
#define LLMOPT_GROUP(NVV)                                                                                   \
  if (nr > 32) prompt_group<3, NVV>(qr, nr, lo + r0, hi + r0, k0, k1, BS, scale, fetch, mr, lr, ar);      \
  else if (nr > 16) prompt_group<2, NVV>(qr, nr, lo + r0, hi + r0, k0, k1, BS, scale, fetch, mr, lr, ar); \
  else prompt_group<1, NVV>(qr, nr, lo + r0, hi + r0, k0, k1, BS, scale, fetch, mr, lr, ar);
    if (D == 32) { LLMOPT_GROUP(2) }
    else if (D == 64) { LLMOPT_GROUP(4) }
    else { LLMOPT_GROUP(8) }
#undef LLMOPT_GROUP
  }
  return true;
}

}  // namespace llmopt::attn
#endif

// GGUF blocks times int8 activations with AVX512_VNNI: the tiles gguf_matmul.cpp runs where the
// CPU has it (most Intel server CPUs since 2019, AMD since Zen 4): `tile` for Q8_0, and for Q4_0 /
// Q4_1 `tile_nibbles` at the end of this file.
//
// The arithmetic is the AVX2 path's (llama.cpp's): per block of 32, an exact integer dot product
// of the weight codes with x quantized to int8, times d_w * d_x, plus m_w * s_x for Q4_1. What
// changes is the cost around that product, which on AVX2 decided the speed (the products are one
// instruction here, `vpdpbusd`: 64 u8 x s8 pairs summed by fours into 16 int32 lanes, signed
// codes offset as below):
// - two blocks per instruction, block b in the low 8 lanes, b + 1 in the high 8;
// - the per-block scales d_w * d_x of 16 blocks at once (one fp16 -> fp32 conversion of 16 d_w,
//   one multiply), each pair's two scales then picked out by one permute; Q4_1's m_w * s_x as one
//   FMA per 16 blocks into the same accumulator;
// - R weight rows x MT rows of x per tile, so R x MT independent accumulators, and each line of
//   W prefetched 4 KB ahead (a row is 300-900 bytes: too short for the hardware prefetcher).
// The integers are the same as AVX2's, so results differ from it only in the order of the
// float32 additions.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define LLMOPT_VNNI512 1
#include <immintrin.h>

namespace llmopt::vnni {

constexpr int64_t PREFETCH = 4096;

// vpdpbusd multiplies unsigned bytes by signed ones, so signed weight codes (Q8_0's int8, Q4_0's
// q - 8) are read as codes + bias (an XOR for Q8_0; Q4_0's nibbles as they are stored), and the
// bias times the activations' sums is taken off again by starting the accumulation from
// -bias * (sum of each 4 values of x), precomputed per row of x. The int32 lanes come out exactly
// as |w| x sign(w) x would make them, one instruction per pair of blocks cheaper.
constexpr int32_t code_bias(int64_t type) { return type == 8 ? 128 : type == 2 ? 8 : 0; }

// Blocks b and b + 1 (64 weights) as unsigned codes: int8 + 128 (Q8_0), q in 0..15 (Q4_0, Q4_1).
template <int64_t TYPE>
inline __m512i load_block_pair(const uint8_t* p) {
  if constexpr (TYPE == 8) return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(char(0x80)));
  // 32 bytes of nibbles -> 128-bit lanes [b, b, b+1, b+1], the second of each pair shifted down 4:
  // each block's low nibbles (weights 0..15), then its high ones (16..31).
  const __m512i t = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i dup = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), t);
  return _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, dup, _mm512_srli_epi16(dup, 4)), _mm512_set1_epi8(0x0F));
}

// 16 int32 lanes: 8 partial sums of block b's products, then 8 of block b + 1's, as floats.
// c: the pair's 16 lane corrections (-bias * sums of 4 x values); unused for Q4_1.
template <int64_t TYPE>
inline __m512 block_pair_dot(__m512i qw, __m512i qx, const int32_t* c) {
  const __m512i start = TYPE == 3 ? _mm512_setzero_si512() : _mm512_loadu_si512(c);
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, qw, qx));
}

// Blocks g .. g + n (n <= 16) of R weight rows against MT rows of x: scale[r][m] = d_w * d_x per block,
// and for Q4_1 the min's part m_w * s_x added to acc at once.
template <int64_t TYPE, int R, int MT, typename Row>
inline void group_scales(const uint16_t* wd, const uint16_t* wm, int64_t row_blocks, int64_t n, const Row* xs,
                         int64_t g, __m512 (&scale)[R][MT], __m512 (&acc)[R][MT]) {
  const __mmask16 mask = __mmask16((1u << n) - 1);
  for (int r = 0; r < R; ++r) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wd + r * row_blocks));
    const __m512 mw = TYPE == 3 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wm + r * row_blocks))
                                : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      scale[r][m] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mask, xs[m].d + g));
      if constexpr (TYPE == 3) acc[r][m] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(mask, xs[m].s + g), acc[r][m]);
    }
  }
}

// out[r * MT + m] = row r of W (blocks at w + r * row_blocks) . row m of x (q, d, s: int8 codes,
// scales and scaled sums per block). nb, the blocks per row, must be even.
template <int64_t TYPE, int R, int MT, typename Row>
inline void tile(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t row_blocks,
                 const Row* xs, float* out) {
  constexpr int64_t BYTES = TYPE == 8 ? 32 : 16;
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t g = 0; g < nb; g += 16) {  // 16 blocks: one vector of scales per (row of W, row of x)
    const int64_t n16 = std::min<int64_t>(16, nb - g);
    __m512 scale[R][MT];
    group_scales<TYPE, R, MT>(wd + g, wm ? wm + g : nullptr, row_blocks, n16, xs, g, scale, acc);
    for (int64_t k = 0; k < n16; k += 2) {
      const int64_t b = g + k;
      const __m512i pick = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(int(k)));
      __m512i qw[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w + (r * row_blocks + b) * BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
        qw[r] = load_block_pair<TYPE>(p);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512i qx = _mm512_loadu_si512(xs[m].q + b * 32);
        for (int r = 0; r < R; ++r)
          acc[r][m] = _mm512_fmadd_ps(block_pair_dot<TYPE>(qw[r], qx, xs[m].c + b * 8), _mm512_permutexvar_ps(pick, scale[r][m]),
                                      acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r * MT + m] = _mm512_reduce_add_ps(acc[r][m]);
}

// Q4_0 / Q4_1, four blocks per instruction pair: the nibbles as stored, x rearranged to meet them.
// A block's 16 bytes hold weights 0..15 in their low nibbles and 16..31 in their high ones, so
// one 64-byte load is four blocks; `and 0x0F` gives their weights 0..15 and `>> 4` their 16..31,
// each matched by one vpdpbusd against x laid out the same way (xs[m].split: per four blocks, their
// x 0..15, then their x 16..31; built once per call). Both products land in the same 4 lanes of a
// block, so a block's int32 sum is 4 lanes, and four blocks share one convert, one scale permute and
// one FMA. Per four blocks that is 11 instructions where `tile` spends 20 (the unpack into block
// order is the rest): on AVX-512 cores that split 512-bit operations in two (AMD Zen 4, this
// course's EPYC) the one-row decode of SmolLM2's Q4_1 layers was bound by those instructions, not by
// memory (their matmuls ran 17% faster from cache than from DRAM).
template <int64_t TYPE, int R, int MT, typename Row>
inline void tile_nibbles(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t row_blocks,
                         const Row* xs, float* out) {
  static_assert(TYPE == 2 || TYPE == 3, "Q4_0 or Q4_1");
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < nb; g += 16) {
    const int64_t n16 = std::min<int64_t>(16, nb - g);
    __m512 scale[R][MT];
    group_scales<TYPE, R, MT>(wd + g, wm ? wm + g : nullptr, row_blocks, n16, xs, g, scale, acc);
    for (int64_t k = 0; k < n16; k += 4) {
      const int64_t b = g + k;
      const __mmask8 blocks = k + 4 <= n16 ? 0xFF : 0x0F;  // the last step of a row may hold 2 blocks
      const __m512i pick = _mm512_add_epi32(quarter, _mm512_set1_epi32(int(k)));
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w + (r * row_blocks + b) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
        const __m512i v = _mm512_maskz_loadu_epi64(blocks, p);
        lo[r] = _mm512_and_si512(v, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xp = xs[m].split + b * 32;
        const __m512i xl = _mm512_loadu_si512(xp), xh = _mm512_loadu_si512(xp + 64);
        const __m512i start = TYPE == 3 ? _mm512_setzero_si512() : _mm512_loadu_si512(xs[m].split_c + b * 4);
        for (int r = 0; r < R; ++r) {
          const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo[r], xl), hi[r], xh);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(pick, scale[r][m]), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r * MT + m] = _mm512_reduce_add_ps(acc[r][m]);
}

// The tile for a block type: `tile` for Q8_0, `tile_nibbles` for Q4_0 and Q4_1.
template <int64_t TYPE, int R, int MT, typename Row>
inline void block_tile(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb, const Row* xs,
                       float* out) {
  if constexpr (TYPE == 8) tile<TYPE, R, MT>(w, wd, wm, nb, nb, xs, out);
  else tile_nibbles<TYPE, R, MT>(w, wd, wm, nb, nb, xs, out);
}

}  // namespace llmopt::vnni
#endif

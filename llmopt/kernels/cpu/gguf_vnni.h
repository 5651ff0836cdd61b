// GGUF blocks times int8 activations with AVX512_VNNI: the tile gguf_matmul.cpp runs where the
// CPU has it (most Intel server CPUs since 2019, AMD since Zen 4).
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
    const __mmask16 mask = __mmask16((1u << n16) - 1);
    __m512 scale[R][MT];
    for (int r = 0; r < R; ++r) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wd + r * row_blocks + g));
      const __m512 mw = TYPE == 3 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wm + r * row_blocks + g))
                                  : _mm512_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        scale[r][m] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mask, xs[m].d + g));
        if constexpr (TYPE == 3) acc[r][m] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(mask, xs[m].s + g), acc[r][m]);
      }
    }
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

}  // namespace llmopt::vnni
#endif

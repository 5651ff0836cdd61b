// GGUF blocks repacked into panels of 16 weight rows, so that one vpdpbusd works for 16 outputs
// at once: the layout llama.cpp's CPU backend repacks Q4_0 / Q8_0 into for its AVX-512 GEMMs
// (its "4x8" / "8x8" interleaved blocks), here for Q8_0, Q4_0 and Q4_1, 16 rows wide.
//
// Why: in the row layout (gguf_vnni.h) a vpdpbusd sums 64 products of one weight row, so each
// block's int32 sum must then be converted, scaled by its own d_w * d_x, and added to that row's
// accumulator: four instructions around every product instruction, and on AMD Zen 4 (512-bit
// operations in two halves) those, not the products, set the speed. In a panel the 16 lanes of
// a vector are 16 weight rows, 4 consecutive weights each, so a block of 32 is 8 vpdpbusd with
// one 4-byte piece of x broadcast to all lanes, and its 16 scales d_w come as one vector: the
// convert, scale and add happen once per block for 16 rows. A tile is MR rows of x times NV
// panels; the weights of a block are read once for the MR rows, and x's pieces are broadcasts.
//
// Panel p, block b, for the 16 rows p*16 .. p*16+15 (`w + (p * nb + b) * 16 * BYTES`):
//   Q8_0: 8 vectors of 64 bytes; vector j holds weights 4j..4j+3 of each row, as codes + 128
//         (unsigned, for vpdpbusd; the 128 * sum(x) this adds is started off below).
//   Q4_x: 4 vectors of 64 bytes; vector t holds bytes 4t..4t+3 of each row's block, whose low
//         nibbles are weights 4t..4t+3 and high nibbles 16+4t..16+4t+3 (GGUF's nibble order).
// d (and Q4_1's m) as fp16 [panels, nb, 16].
#pragma once

#include "gguf_vnni.h"

#ifdef LLMOPT_VNNI512
namespace llmopt::panels {

// The rows of x as a tile reads them: int8 codes [M, K], per block d_x (fp32), Q4_1's
// s_x = d_x * sum(q_x), and c = -bias * sum(q_x) (int32; Q8_0 and Q4_0, vnni::code_bias).
struct XBlocks {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* c;
  int64_t K, nb;
};

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[m, 16p .. 16(p + NV)) for the MR rows of x starting at m0, panels p .. p + NV.
template <int64_t TYPE, int MR, int NV>
inline void tile(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, const XBlocks& x, int64_t m0, int64_t p,
                 float* y, int64_t N, int64_t ahead) {
  constexpr int64_t BYTES = TYPE == 8 ? 32 : 16;
  const int64_t nb = x.nb;
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[NV];
    __m512 dw[NV], mw[NV];
    for (int v = 0; v < NV; ++v) {
      const int64_t at = (p + v) * nb + b;
      wb[v] = w + at * 16 * BYTES;
      for (int64_t line = 0; ahead && line < 16 * BYTES; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb[v]) + ahead + line, _MM_HINT_T1);
      dw[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + at * 16)));
      if constexpr (TYPE == 3) mw[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wm + at * 16)));
    }
    __m512i ia[MR][NV];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = TYPE == 3 ? _mm512_setzero_si512() : _mm512_set1_epi32(x.c[(m0 + m) * nb + b]);
      for (int v = 0; v < NV; ++v) ia[m][v] = start;
    }
    const int8_t* xb = x.q + m0 * x.K + b * 32;
    if constexpr (TYPE == 8) {
      for (int j = 0; j < 8; ++j)
        for (int v = 0; v < NV; ++v) {
          const __m512i wv = _mm512_loadu_si512(wb[v] + 64 * j);
          for (int m = 0; m < MR; ++m) ia[m][v] = _mm512_dpbusd_epi32(ia[m][v], wv, bcast4(xb + m * x.K + 4 * j));
        }
    } else {
      for (int t = 0; t < 4; ++t)
        for (int v = 0; v < NV; ++v) {
          const __m512i raw = _mm512_loadu_si512(wb[v] + 64 * t);
          const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
          for (int m = 0; m < MR; ++m) {
            ia[m][v] = _mm512_dpbusd_epi32(ia[m][v], lo, bcast4(xb + m * x.K + 4 * t));
            ia[m][v] = _mm512_dpbusd_epi32(ia[m][v], hi, bcast4(xb + m * x.K + 16 + 4 * t));
          }
        }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + m) * nb + b]);
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][v]), _mm512_mul_ps(dw[v], dx), acc[m][v]);
        if constexpr (TYPE == 3) acc[m][v] = _mm512_fmadd_ps(mw[v], _mm512_set1_ps(x.s[(m0 + m) * nb + b]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + (m0 + m) * N + (p + v) * 16, acc[m][v]);
}

}  // namespace llmopt::panels
#endif

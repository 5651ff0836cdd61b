"""llama.cpp's k-quants Q4_K and Q6_K, written from the format's definition.

The legacy GGUF types give every 32 weights their own fp16 scale (Q4_0) or scale and
minimum (Q4_1): 4.5 or 5 bits a weight. The k-quants add a second level. A *super-block*
of 256 weights carries one fp16 scale `d` (and for Q4_K one fp16 `dmin`); its sub-blocks
carry small integer scales that multiply it, so the per-group scales cost 6 or 8 bits
instead of 16:

    Q4_K  (144 bytes / 256 weights = 4.5 bits): 8 sub-blocks of 32, each a 6-bit scale sc_j
          and a 6-bit minimum m_j;  w = d * sc_j * q - dmin * m_j,  q in [0, 16)
    Q6_K  (210 bytes / 256 weights = 6.5625 bits): 16 sub-blocks of 16, each an int8 scale
          sc_j;  w = d * sc_j * (q - 32),  q in [0, 64)

Byte layouts (what `gguf.quants.dequantize` reads, and what is written here):

    Q4_K: d f16 | dmin f16 | scales[12] | qs[128]
          scales: bytes 0-3 hold sc_0..3 in their low 6 bits, bytes 4-7 m_0..3; bytes 8-11
          hold the low 4 bits of sc_4..7 (low nibble) and m_4..7 (high nibble), and the top
          2 bits of bytes 0-3 / 4-7 hold the top 2 bits of sc_4..7 / m_4..7.
          qs: 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, high nibbles 2c+1.
    Q6_K: ql[128] | qh[64] | scales[16] int8 | d f16
          weight e = 128 h + r (h = 0, 1): its low 4 bits are nibble r // 64 of ql[64 h + r % 64],
          its top 2 bits are bits 2 (r // 32) of qh[32 h + r % 32].

The quantizers here are round-to-nearest at both levels (sub-block scale and minimum from
the sub-block's range, then those rounded to 6 or 8 bits against the super-block's scale,
then the weights rounded against the rounded scales). llama.cpp searches a few candidate
scales per sub-block (make_qkx2_quants) for a slightly lower error; the bytes mean the same.

Loaded with quantization="gguf", a file's k-quant bytes are not dequantized: the C++ kernels
multiply them as they lie (llmopt.kernels.cpu.kquant_blocks).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 144
Q6_K_BYTES = 210


def _blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % QK_K:
        raise ValueError(f"k-quants need rows of a multiple of {QK_K} weights, got {w.shape[-1]}")
    return w.reshape(-1, QK_K)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


# -- Q4_K ----------------------------------------------------------------------------------------------
def q4_k_integers(w: np.ndarray):
    """Blocks [n, 256] -> (d [n], dmin [n], sc [n, 8], m [n, 8], q [n, 256]) as stored."""
    x = _blocks(w).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0)                                  # a sub-block's minimum (<= 0)
    hi = x.max(-1)
    scale = (hi - lo) / 15                                         # [n, 8]
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc                                         # the rounded scales
    offset = dmin[:, None] * m
    q = np.clip(np.rint(_safe_div(x + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    return d, dmin, sc, m, q.reshape(-1, QK_K)


def q4_k_dequantize_integers(d, dmin, sc, m, q) -> np.ndarray:
    """The definition: w = d * sc_j * q - dmin * m_j, per sub-block j of 32."""
    q = q.reshape(-1, 8, 32).astype(np.float32)
    w = (d[:, None] * sc)[..., None] * q - (dmin[:, None] * m)[..., None]
    return w.reshape(-1, QK_K)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float rows (length a multiple of 256) -> Q4_K bytes [n_rows, 144 * row / 256]."""
    rows = np.asarray(w).reshape(-1, np.asarray(w).shape[-1]).shape[0]
    d, dmin, sc, m, q = q4_k_integers(w)
    scales = np.empty((len(d), 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)                                    # chunk, (low, high) nibble, byte
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(rows, -1)


# -- Q6_K ----------------------------------------------------------------------------------------------
def q6_k_integers(w: np.ndarray):
    """Blocks [n, 256] -> (d [n], sc [n, 16] int8, q [n, 256] in [0, 64)) as stored."""
    x = _blocks(w).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31                                 # [n, 16]; q - 32 in [-31, 31]
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(_safe_div(x, step[..., None])), -32, 31) + 32
    return d, sc, q.astype(np.uint8).reshape(-1, QK_K)


def q6_k_dequantize_integers(d, sc, q) -> np.ndarray:
    """The definition: w = d * sc_j * (q - 32), per sub-block j of 16."""
    q = q.reshape(-1, 16, 16).astype(np.float32) - 32
    return ((d[:, None] * sc.astype(np.float32))[..., None] * q).reshape(-1, QK_K)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float rows (length a multiple of 256) -> Q6_K bytes [n_rows, 210 * row / 256]."""
    rows = np.asarray(w).reshape(-1, np.asarray(w).shape[-1]).shape[0]
    d, sc, q = q6_k_integers(w)
    q = q.reshape(-1, 2, 128)                                      # half h, r
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h4 = high.reshape(-1, 2, 4, 32)                                # r = 32 s + b: bits 2s of qh[32 h + b]
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(rows, -1)

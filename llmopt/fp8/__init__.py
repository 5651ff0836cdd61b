"""FP8: 8-bit floating point, for weights, activations and the KV cache.

- `format`: the e4m3 / e5m2 formats, their scales, rounding onto them, and which devices multiply
  in FP8 (a plain record every floor may use);
- `linear`: `Fp8Linear`, FP8 weights (W8A8 where FP8 units multiply, W8A16 elsewhere);
- `kv_scales`: an FP8 KV pool's per-layer scales from a checkpoint, and the text to calibrate them on.

The kernels that read an FP8 pool are in llmopt/kernels/.
"""

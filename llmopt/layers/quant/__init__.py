"""Quantized weights in the decoder: their formats and the linears that multiply by them.

- `formats`: a quantized weight in memory (`QuantizedWeight`), the bit packing the hub's layouts
  share, and a checkpoint's quantization config read into a `QuantScheme`;
- `linear`: `QuantLinear`, the contract every quantized linear keeps (and `GroupQuantLinear`);
- one file per format, with its layout, its linear and its dequantize reference: `gptq`, `awq`,
  `int8`, `nf4` (QLoRA's NF4), `gguf_linear` (a GGUF file's blocks as stored);
- `cpu_int`: torch's int8 / int4 CPU kernels the linears call at decode batch sizes;
- `registry`: the linear a scheme asks for. The FP8 linear lives with FP8 (llmopt/fp8/linear.py).
"""

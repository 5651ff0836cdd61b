"""Weight quantization: RTN, GPTQ, AWQ and NF4 written out, and hub-compatible checkpoints.

    from llmopt.quant import quantize
    quantize("tiny", method="gptq", bits=4, group_size=128, out="q/tiny-gptq")
    LLM(model="q/tiny-gptq")    # detected from config.json's quantization_config

rtn.py (the grid), gptq.py, awq.py: the algorithms; nf4.py: QLoRA's NormalFloat and the
bitsandbytes layout; rotation.py: Hadamard rotations folded in before any of them
(`rotation="hadamard"`); calibration.py: activations block by block; formats.py: packing into
the GPTQ / AWQ layouts and reading quantization_config; checkpoint.py: writing the folder;
quantizer.py: `quantize`, which ties them together.
"""

from llmopt.layers.quant.formats import QuantizedWeight, QuantScheme
from llmopt.quant.quantizer import METHODS, QuantizeResult, quantize

__all__ = ["quantize", "QuantizeResult", "QuantizedWeight", "QuantScheme", "METHODS"]

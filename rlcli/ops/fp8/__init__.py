"""FP8 block-scaled numerics (the DeepSeek-V3 recipe): quantization, GEMM backends, linear layers, module swap.

See ``quant`` (formats and layouts, the torch reference), ``kernels`` (the same quantization as
one-pass Triton kernels), ``runtime`` (which quantizer runs; weights once per optimizer step),
``backends`` (deep_gemm / torch scaled_mm / emulated), ``linear`` (autograd recipe), ``convert``
(which layers go FP8).
"""

from rlcli.ops.fp8.backends import GemmBackend, make_backend
from rlcli.ops.fp8.linear import FP8Linear, fp8_grouped_mm, fp8_linear
from rlcli.ops.fp8.quant import dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128

__all__ = ["GemmBackend", "make_backend", "FP8Linear", "fp8_grouped_mm", "fp8_linear", "quantize_1x128",
           "quantize_128x128", "dequantize_1x128", "dequantize_128x128"]

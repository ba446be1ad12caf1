"""Weight formats of the routed experts: native (lossless), int8, int4 (lossy: the user's choice).

    formats.py  ``WeightFormat``: the names, int4's group size, how reports label them
                (no torch: a store's index reads it)
    kernels.py  one matrix quantized, multiplied and dequantized with torch's CPU kernels
                (on CUDA tensors, through cuda_kernels)
    int4_layout.py  int4 between the CPU kernels' packed layouts, the values and CUDA's
    cuda_kernels.py  the stored bytes through torch's CUDA weight-only kernels
    experts.py  an experts module's weights in a format, ``quantize_model`` (the resident
                reference) and the ``stmoe_quantized`` experts implementation
    linears.py  the resident linears (attention, shared experts, lm_head) in a format
"""

from stmoe.quant.formats import NATIVE, WeightFormat, parse_format

__all__ = ["NATIVE", "WeightFormat", "parse_format"]

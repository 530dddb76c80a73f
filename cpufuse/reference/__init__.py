"""float64 references (the executable definitions the kernels are tested against): ops (softmax,
rms_norm, flash_attn, ...), quant (activation quantizers, weight makers, matmul references), archs
(a float64 forward of a GGUF model), block (a decoder block as a graph and its numpy / float64
twins) and opbyop (the model's forward one public op at a time, the decoder graph's reference)."""
from .ops import alibi_slopes, flash_attn, nmse, rms_norm, rope, softmax, tile_mask, tile_to  # noqa: F401

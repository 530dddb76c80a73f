"""float64 references (the executable definitions the kernels are tested against): ops (softmax,
rms_norm, flash_attn, ...) and quant (activation quantizers, weight makers, matmul references)."""
from .ops import alibi_slopes, flash_attn, nmse, rms_norm, softmax, tile_mask, tile_to  # noqa: F401

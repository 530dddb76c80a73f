"""Quantized GGUF weights: the type table and QTensor (types), the fused dequantize x matmul
(matmul). The public names are exported as cpufuse.QTensor, cpufuse.matmul, ..."""

"""The public kernels (softmax, rms_norm, add_rms_norm, flash_attn, rope): argument checks, output
allocation and the call into the registry's kernel. The functions are exported as cpufuse.<name>."""

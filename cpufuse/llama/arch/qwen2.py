"""qwen2: llama's blocks with Q/K/V biases (tiny.py writes them), RoPE NEOX."""
from .llama import forward as llama_forward
from .spec import Arch, llama_layer_tensors

ARCH = Arch("qwen2", rank=1, rope="neox", forward=llama_forward, layer_tensors=llama_layer_tensors,
            tiny_options={"biases": True})

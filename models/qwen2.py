"""qwen2: the llama block with Q/K/V biases and NeoX-layout RoPE (biases load with the QKV
weights in the base)."""

from edgeinfer.kernels.activations import SILU

from .base import DecoderModel


class Qwen2(DecoderModel):
    rope_neox = True
    activation = SILU

"""qwen3: the llama block with per-head RMS norm on Q and K before RoPE (NeoX layout), no biases.
The QK-norm weights load in the base and are applied inside the attention kernel."""

from edgeinfer.kernels.activations import SILU

from .base import DecoderModel


class Qwen3(DecoderModel):
    rope_neox = True
    activation = SILU

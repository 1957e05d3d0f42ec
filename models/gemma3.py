"""gemma3: sandwich norms (post-attention and post-FFN RMS norms before each residual add),
QK-norm, GeGLU (tanh GELU), embeddings scaled by sqrt(n_embd), queries scaled by
1/sqrt(key_length) (ModelConfig.attn_scale), tied output head, and local layers that attend
within a sliding window with their own RoPE base (every `sliding_pattern`-th layer is global).

Gemma's RMS norm multiplies by (1 + w); GGUF conversion already stores 1 + w, so the weights are
used as they are, as llama.cpp does.
"""

import math

import numpy as np

from edgeinfer.kernels.activations import GELU_TANH
from edgeinfer.kernels.rope import rope_inv_freq

from .base import DecoderModel


class Gemma3(DecoderModel):
    rope_neox = True
    activation = GELU_TANH

    def embedding_scale(self) -> float:
        return float(np.float32(math.sqrt(self.config.n_embd)))

    def layer_geometry(self, i: int) -> tuple[np.ndarray, int]:
        c = self.config
        if c.is_sliding(i):
            # Local layers keep unscaled RoPE at their own base; scaling applies to global ones.
            return rope_inv_freq(c.rope_dim, c.rope_base_local), c.sliding_window
        return super().layer_geometry(i)

"""llama: Llama 2/3, Mistral, TinyLlama, SmolLM — the plain pre-norm block with SwiGLU.

RoPE in ggml's normal (interleaved pairs) layout: GGUF conversion permutes Q/K rows for it.
Optional: a separate output head (else tied to token_embd), attention/FFN biases, linear RoPE
scaling and llama3 per-frequency factors (the rope_freqs tensor) — all handled by the base.
"""

from edgeinfer.kernels.activations import SILU

from .base import DecoderModel


class Llama(DecoderModel):
    rope_neox = False
    activation = SILU

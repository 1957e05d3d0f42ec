"""Each architecture's tensors as llama.cpp names and loads them: the one place that says which
tensors a file of an architecture has and their shapes. ModelConfig checks a file against it
before anything loads, and the loader (`base.WeightLoader`) reads only names listed here.
No kernel imports: validating a file stays cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeinfer.gguf.model_config import ModelConfig


def tensor_shapes(c: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(required, optional) tensor name -> numpy shape (out, in), as llama.cpp loads them."""
    q_dim, k_dim, v_dim = (
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.n_kv_heads * c.v_head_dim,
    )
    required = {
        "token_embd.weight": (c.vocab_size, c.n_embd),
        "output_norm.weight": (c.n_embd,),
    }
    optional = {"output.weight": (c.vocab_size, c.n_embd)}
    if c.arch == "llama":
        optional["rope_freqs.weight"] = (c.rope_dim // 2,)
    if c.arch == "qwen2":
        optional["output.bias"] = (c.vocab_size,)
    for i in range(c.n_layers):
        b = f"blk.{i}."
        required.update(
            {
                b + "attn_norm.weight": (c.n_embd,),
                b + "attn_q.weight": (q_dim, c.n_embd),
                b + "attn_k.weight": (k_dim, c.n_embd),
                b + "attn_v.weight": (v_dim, c.n_embd),
                b + "attn_output.weight": (c.n_embd, c.n_heads * c.v_head_dim),
                b + "ffn_norm.weight": (c.n_embd,),
                b + "ffn_gate.weight": (c.n_ff, c.n_embd),
                b + "ffn_up.weight": (c.n_ff, c.n_embd),
                b + "ffn_down.weight": (c.n_embd, c.n_ff),
            }
        )
        optional.update(
            {b + "attn_q.bias": (q_dim,), b + "attn_k.bias": (k_dim,), b + "attn_v.bias": (v_dim,)}
        )
        if c.arch in ("qwen3", "gemma3"):
            required[b + "attn_q_norm.weight"] = (c.head_dim,)
            required[b + "attn_k_norm.weight"] = (c.head_dim,)
        if c.arch == "gemma3":
            required[b + "post_attention_norm.weight"] = (c.n_embd,)
            required[b + "post_ffw_norm.weight"] = (c.n_embd,)
        if c.arch == "llama":
            optional.update(
                {
                    b + "attn_output.bias": (c.n_embd,),
                    b + "ffn_gate.bias": (c.n_ff,),
                    b + "ffn_up.bias": (c.n_ff,),
                    b + "ffn_down.bias": (c.n_embd,),
                }
            )
    return required, optional

"""Layers through llama.cpp's ggml backends (CUDA on a GPU; ggml's CPU backend as the stand-in),
inside edgeinfer's engine: same scheduler, block ids, prefix cache and sampler; only a span of
layers' arithmetic and their KV storage move (design.md §8).

lib        ctypes bindings to llama-cpp-python's libggml*.so.0 and the ABI guard
placement  --offload / --gpu-layers parsed into a Span (no ggml)
backends   opening `cpu` / `cuda[:N]`, loading backend modules, device memory
graph      shape-checked graph building (ggml aborts on a failed assert)
layers     the decoder block as a graph, per architecture feature
weights    the span's weights uploaded once (mapped in place on a host device)
kv         the span's KV cache on the backend, addressed by the host cache's slots; masks
span       SpanExecutor: one graph per step, cached by token-count and context buckets
"""

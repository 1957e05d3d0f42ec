"""The serving core: requests (`Sequence`), the continuous-batching `Scheduler` and its
`BlockManager`, the `ModelRunner` that turns a scheduled batch into arrays, the paged KV cache,
sampling, and the memory plan that sizes it all."""

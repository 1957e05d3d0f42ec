"""Quantization lab: perplexity and KL divergence over text windows (llama-perplexity's rules
and report), per-tensor weight error between two files, and llama.cpp's quantizer.

stats.py      per-token statistics -> perplexity, KL divergence, top-1, delta-p
windows.py    the text -> windows -> engine -> statistics runner
logits_file.py  llama-perplexity's saved log-probabilities (`--kl-divergence-base` files)
weights.py    per-tensor NMSE / max error and bits per weight of GGUF files
quantize.py   llama.cpp's quantizer with progress, checks and clean failure
"""

"""Model files: the validating GGUF reader, the architecture config read from its metadata, and
the hub that resolves short names to pulled files."""

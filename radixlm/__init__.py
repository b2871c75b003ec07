"""radixlm: LM programs on a radix-tree KV cache runtime."""

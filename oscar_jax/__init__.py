"""OSCAR-JAX runtime: the model, weight loaders, tokenizer and the 2-bit KV cache (JAX/Pallas)."""

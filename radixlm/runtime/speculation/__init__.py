"""Speculative decoding: drafts from what the runtime holds (the request's own tokens, the radix
cache), checked by the model in one forward pass (docs/engine.md, "Speculative decoding")."""

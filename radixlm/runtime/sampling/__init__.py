"""Sampling: the batched sampler over a step's logits (sampler.py) and the engine's stage that
builds its batch from the requests, masks constrained rows and draws (stage.py)."""

"""The torch side: KV-cache tensors, kernels, attention backends, models, sampler, runners.

Adapters consume :class:`pagedinfer.domain.BatchPlan` objects and never import the engine.
"""

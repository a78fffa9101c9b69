"""The torch side: KV-cache tensors, kernels, attention backends, models, sampler, runners.

Adapters consume :class:`pagedinfer.domain.BatchPlan` objects and never import the engine.
"""

from pagedinfer._extras import require_engine_extra

require_engine_extra("pagedinfer.adapters (the torch side: models, kernels, sampler)")

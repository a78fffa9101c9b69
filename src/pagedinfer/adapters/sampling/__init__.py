"""Sampling on the device: from a step's logits to its token ids (the sampling rank only).

Map (data flows top to bottom in ``SamplingPipeline.sample``):

* ``pipeline.py`` — :class:`SamplingPipeline`: one step's sampling in three calls (begin: the
  plan's table deltas; sample: the passes below, launched; read: the ids and logprobs on the
  host), and the records of what each step changed in the per-request state, undone when the
  scheduler drops the step.
* ``table.py`` — :class:`SamplingTable`: every live request's parameters by slot, a host mirror
  and device columns, following the plans' install / release deltas; its callbacks keep the
  per-slot state below in step.
* ``batch.py`` — :class:`SamplingBatch`: one step's rows gathered from the table, with host
  flags saying which passes any row needs.
* ``grammar.py`` — structured outputs: grammars compiled (and cached) from
  ``StructuredOutputsParams``, one matcher per constrained slot, the step's token bitmask
  filled on the host and applied on the device in one masked fill.
* ``logprobs.py`` — which requests asked for logprobs; ``log_softmax`` and the top-k entries.
* ``logprobs_mode.py`` — the engine's ``logprobs_mode``: raw (the model's) or processed (the
  sampler's) logprobs or logits.
* ``logits_processors.py`` — allowed ids, ``logit_bias``, ``min_tokens``, ``min_p`` and
  (with ``penalties.py``) presence / frequency / repetition penalties, as per-row tables.
* ``sampler.py`` — :class:`Sampler`: greedy, temperature, top-k / top-p, then the
  exponential race (the fused CUDA race for temperature-only steps).
* ``noise.py`` — the race's noise: the engine's generator, or a counter-based hash of
  (seed, sample step, token) for seeded rows.

The order within a step is vLLM v1's: grammar mask, logprobs, processing (bias, masks,
penalties), temperature, ``min_p``, top-k, top-p, the race.
"""

"""Speculative decoding's proposers that run a model (the n-gram lookup is in the domain)."""

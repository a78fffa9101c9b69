"""Pooling models (``runner="pooling"``): hidden states pooled per prompt, and the
classification heads read from a checkpoint."""

"""Tensor parallelism: the process group handle, worker processes, the control channel."""

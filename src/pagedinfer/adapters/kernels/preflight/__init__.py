"""The GPU preflight: every Triton kernel, in every configuration the engine launches,
compiled for sm_80, sm_89 and sm_90 on the CPU, with no device (``make gpu-preflight``).

:mod:`.sweep` records the launches, :mod:`.compile` compiles one, :mod:`.run` plans and runs
the compiles, :mod:`.report` prints them; ``python -m pagedinfer.adapters.kernels.preflight
--help`` runs it all. Run it without ``TRITON_INTERPRET`` (the kernels must be real
``triton.jit`` functions).
"""

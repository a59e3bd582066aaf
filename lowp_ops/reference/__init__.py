"""Pure-PyTorch eager implementations: the semantics, the CPU kernels and the test oracles.

Nothing here imports triton.
"""

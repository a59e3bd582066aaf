"""Triton kernels and their launchers. Launchers take and return plain tensors; no torch.library here."""

"""Optional integrations with model libraries (each submodule imports its library only when imported).

- :mod:`lowp_ops.integrations.transformers`: ``apply_lowp_ops(model)`` for Hugging Face causal LMs
  (``pip install lowp_ops[transformers]``).
"""

"""Attention ops. Each op is a pure-jnp reference (the specification); Pallas kernels join them later.

This package imports nothing from glm53, kvcache or parallel.
"""

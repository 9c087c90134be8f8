"""Flax modules built from the toolkit's model specs (MLP, CNN, GPT) for both JAX backends."""

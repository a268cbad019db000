"""Ablation sweeps: one train.py run per (variant, seed), their results table and plots; imports no JAX."""

"""Experiment configs (ml-collections), one file each, plus their validation."""

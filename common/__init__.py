"""Definitions every layer shares: errors, checks of config fields, special token ids, process roles and mesh axes.

Entry points, `training/`, `models/`, `input_pipeline/` and `configs/` may all import
from here; it imports from none of them.
"""

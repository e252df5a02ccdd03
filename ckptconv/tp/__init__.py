"""Tensor-parallel layout: partition rules and presets (rules.py), and how each tensor is split
over the ranks of a mesh (layout.py). Pure data: nothing here reads or writes files."""

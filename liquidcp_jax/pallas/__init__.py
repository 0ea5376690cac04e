"""Pallas Mosaic GPU tile-attention kernels (Hopper). Entry point: :mod:`.api`."""

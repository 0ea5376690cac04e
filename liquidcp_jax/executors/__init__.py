"""Executors run MegaRing / MegaDCP task tables: ``xla`` (portable) and ``pallas`` (Mosaic GPU)."""

"""Stage-serialized baselines the paper compares against.

``baselines.dcp``: the vLLM (AG+RS, A2A) and SGLang (AG+AR) decode-CP paths on the XLA executor.
``baselines.training``: the per-step zigzag ring (ring-flash-attention / Megatron CP style) and the
KV all-gather (Llama-3 style) context-parallel attention, for comparison with MegaRing.
"""

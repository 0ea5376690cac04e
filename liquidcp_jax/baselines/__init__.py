"""Stage-serialized baselines the paper compares against.

``baselines.dcp``: the vLLM (AG+RS, A2A) and SGLang (AG+AR) decode-CP paths on the XLA executor.
"""

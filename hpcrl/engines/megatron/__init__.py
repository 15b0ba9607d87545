"""The Megatron-core training engine (TP/PP/DP with the distributed optimizer) for Qwen2/LLaMA.

Nothing is imported here. Only `engine` and `model` need megatron-core (`pip install
hpcrl[megatron]`, see hpcrl.engines.registry); the other modules load with torch alone.
"""

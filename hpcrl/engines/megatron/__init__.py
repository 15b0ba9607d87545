"""The Megatron-core training engine (TP/PP/DP with the distributed optimizer) for Qwen2/LLaMA.

Nothing is imported here: `config`, `groups` and `vocab_parallel` load without megatron-core,
`engine` and `model` need `pip install hpcrl[megatron]` (see hpcrl.engines.registry).
"""

"""The team's GPT, built from Megatron-Core tensor-parallel layers.

Nothing here creates a process group or calls a collective directly: each block gets a
`TransformerConfig` and Megatron-Core's layers and parallel state do the communication. The model's
sizes come from one `ModelShape` (models/shape.py); a layer's blocks from its spec (models/spec.py).
Import from the modules (models.gpt, models.shape, ...): importing models.shape alone stays light
(no Megatron-Core), which the config checks rely on.
"""

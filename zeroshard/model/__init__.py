"""Model-level helpers over a model a ZeroOptimizer manages, at any stage: the full state dict
(``full_state_dict``), weights from safetensors files read per owned range (``load_safetensors``)
and values for a model built on the meta device (``init_meta_weights``). They find the
optimizer through the registry (zeroshard/optim/registry.py), above the engine like the
checkpoint consumers (Note [the layers] in docs/design.md)."""

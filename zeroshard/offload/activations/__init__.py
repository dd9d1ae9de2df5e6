"""Activation offload: the tensors autograd saves in the covered blocks' forward wait in host memory
or NVMe files for their backward (Note [activation offload] in offloader.py)."""
from zeroshard.offload.activations.activation_options import ActivationOffload, activation_options

__all__ = ["ActivationOffload", "activation_options"]

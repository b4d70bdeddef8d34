"""Torch-side actuators of the adaptive controller: the KV width rule and the pool rule act on the
runner's tensors here; the rules themselves stay torch-free in nanokv.gateway.adaptive."""

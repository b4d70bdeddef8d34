"""KV formats and attention metadata: the bottom layer that kernels, compute and cache all share.

Full precision, int8 and int4 block layouts, their (de)quantization reference, the int4 staging
table, the INT4 demotion store and the per-step AttentionMetadata. Imports torch and nanokv.errors
only: never a service or the kernels."""

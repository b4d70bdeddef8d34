"""KV formats: full precision, int8, int4; the per-layer bit plan; (de)quantization reference."""

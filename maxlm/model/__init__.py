"""The decoder: transformer layers, RoPE, segment-aware attention kernels."""

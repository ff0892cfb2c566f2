"""attnhub plugin triton_portable."""

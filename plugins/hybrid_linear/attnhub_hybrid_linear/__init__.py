"""attnhub plugin hybrid_linear."""

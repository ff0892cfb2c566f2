"""attnhub plugin sm80_fa2."""

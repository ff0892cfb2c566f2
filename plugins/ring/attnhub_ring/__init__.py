"""attnhub plugin ring."""

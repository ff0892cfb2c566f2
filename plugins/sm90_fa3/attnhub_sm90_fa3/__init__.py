"""attnhub plugin sm90_fa3."""

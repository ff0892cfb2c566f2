"""attnhub-example: a minimal backend plugin. Importing it is cheap (no kernels, no GPU)."""

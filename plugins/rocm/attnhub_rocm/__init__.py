"""attnhub plugin rocm."""

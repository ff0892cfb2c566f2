"""Bridges from model libraries to attnhub (imported on demand, never by ``import attnhub``)."""

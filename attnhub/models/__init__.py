"""Built-in models that attnhub binds and runs (``attnhub run``, ``bench``, ``profile``)."""

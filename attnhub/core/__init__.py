"""The core model: specs, devices, capabilities, backends, registry, reference attention."""

"""Routes of the Tinker-compatible service, one module per resource, at the SDK's paths."""

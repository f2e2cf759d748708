"""Routes of the reward service, one module per resource."""

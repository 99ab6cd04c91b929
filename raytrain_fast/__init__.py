"""raytrain_fast."""

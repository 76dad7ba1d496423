"""Device-side helpers shared by the kernels (PTX-level building blocks)."""

"""CuTe DSL kernels: one file per op (arch-neutral) or per arch x op."""

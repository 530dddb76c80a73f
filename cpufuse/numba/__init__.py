"""Numba fallbacks (the "numba" ISA): the same kernels as native/kernels, written in Numba."""

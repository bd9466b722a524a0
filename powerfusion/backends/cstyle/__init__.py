"""The C-style renderer shared by the GPU dialects (CUDA, HIP): GIR kernels -> C source."""

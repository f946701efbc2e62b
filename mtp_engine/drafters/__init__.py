"""Drafters: the MLX head (`mlx_head`, every mode; its forward compiled by
`compiled_head`), the C++ head on the CPU (`cpp_head`, chain and adaptive)
and the CUDA chain kernel (`cuda_chain`, chain). All implement
`base.Drafter`; `select` builds them for an engine and picks one per mode."""

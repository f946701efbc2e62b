"""Drafters for the rows of a batch: the MLX head (`head`, every mode; its
forward compiled by `compiled_head`), the C++ head on the CPU (`cpp_head`,
greedy chain and adaptive) and the CUDA chain kernel (`cuda_chain`, every row's
chain, greedy or exact-sampler, in one launch). All implement `base.Drafter`; `select` builds what an
engine shares and makes a decoder's drafter."""

"""Placeholder: drop-in scaled_dot_product_attention -- being written."""


def parallel_sdpa(state):
    raise NotImplementedError("seqpar.parallel_sdpa is being written")

"""Placeholder: packed variable-length attention -- being written."""


def varlen_attention(q, k, v, state, seq_lens, *, causal=False, softmax_scale=None, backend="auto"):
    raise NotImplementedError("seqpar.varlen_attention is being written")

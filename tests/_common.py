"""Shared test constants: dtypes by name and the float tolerances against float64 references."""

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Max abs error against a float64 reference, relative to the reference's magnitude; half types are
# judged by flash-attn's rule instead (error at most ~2x that of a same-dtype PyTorch computation).
TOL = {"float64": 1e-10, "float32": 1e-4}

"""Kernel tests run the Triton kernels on CPU tensors in triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is imported: triton decides at import time whether its
own @triton.jit helpers (tl.sort, tl.topk, ...) are interpreted. Pytest imports this file before it
collects the test modules beside it, and latentmoe_lab never imports triton on its own (checked by
tests/test_ops_backend.py), so setting the variable here comes first. Should something import
triton earlier in the same process, the guard below stops with the way out instead of letting the
kernels fail obscurely.
"""
import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/kernels: triton was imported before TRITON_INTERPRET=1 could be set; "
                       "run `TRITON_INTERPRET=1 python -m pytest tests/kernels` in a process of its own")
os.environ["TRITON_INTERPRET"] = "1"

"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here (pytest
loads this file before the test modules). GPU runs leave it unset and compile for real.
"""

from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_index_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar (a 1-element array) into a Python int with
    `int(array)`, which numpy >= 2.4 rejects for 1-D arrays: every `range(lo, hi)` with a
    runtime bound fails. Patch that one conversion until triton ships the fix."""
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index_for_numpy_2_4()

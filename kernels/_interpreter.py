"""Speed-up of Triton's interpreter for the CPU runs of the Triton kernels (tests, CPU smoke runs)."""

from __future__ import annotations


def vectorize_interpreter_scan() -> None:
    """Make Triton's interpreter (``TRITON_INTERPRET=1``) run ``tl.associative_scan`` with a user combine
    function one position of the scanned axis at a time on whole slices (numpy), instead of one element at a
    time in Python.

    The order of the combines is the interpreter's own (a left fold along the axis, the axis flipped
    for ``reverse=True``), so the results are the same; a (4, 16, 64) scan takes ~64 combine calls
    instead of ~4096.  Used by the tests; no effect on a GPU run.  A no-op without triton or when already applied."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    ops = getattr(interpreter, "ScanOps", None)
    if ops is None or getattr(ops, "_certblocks_vectorized", False):
        return

    def generic_scan(self, input):
        datas = [arg.handle.data for arg in input]
        outs = [np.empty_like(d) for d in datas]
        ax = self.axis
        acc = None
        for i in range(datas[0].shape[ax]):
            cur = tuple(self.to_tensor(np.take(d, [i], axis=ax), x.dtype) for d, x in zip(datas, input))
            if acc is None:
                acc = cur
            else:
                ret = self.combine_fn.fn(*acc, *cur)
                acc = ret if isinstance(ret, tuple) else (ret,)
            for o, a in zip(outs, acc):
                idx = [slice(None)] * o.ndim
                idx[ax] = slice(i, i + 1)
                o[tuple(idx)] = a.handle.data
        return [self.to_tensor(o, x.dtype) for o, x in zip(outs, input)]

    ops.generic_scan = generic_scan
    ops._certblocks_vectorized = True

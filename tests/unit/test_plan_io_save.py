"""plan_io keeps a constant file that already holds the same array and rewrites one that differs."""
import os

import numpy as np

from powerfusion.pipeline.plan_io import _save


def test_constant_file_rewritten_only_when_it_differs(tmp_path):
    p = tmp_path / "w.npy"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    _save(p, a)
    os.utime(p, (1, 1))
    _save(p, a.copy())
    assert p.stat().st_mtime == 1                       # same array: left alone
    _save(p, a + 1)
    assert np.array_equal(np.load(p), a + 1)            # different values: rewritten
    _save(p, (a + 1).astype(np.float64))
    assert np.load(p).dtype == np.float64               # different dtype: rewritten
    p.write_bytes(b"not an npy file")
    _save(p, a)
    assert np.array_equal(np.load(p), a)                # unreadable: rewritten

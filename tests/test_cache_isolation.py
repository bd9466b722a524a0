"""The test run compiles into its own cache folder (tests/conftest.py), never the user's."""
from __future__ import annotations

import os
from pathlib import Path


def test_the_run_compiles_into_its_own_cache_folder(isolated_cache_dir):
    from powerfusion import options
    from powerfusion.pipeline import plancache
    from powerfusion.runtime.cache import default_cache_dir
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "powerfusion"
    assert isolated_cache_dir != user
    assert options.current().cache_dir == isolated_cache_dir
    assert os.environ["POWERFUSION_CACHE_DIR"] == str(isolated_cache_dir)   # for the CLI's subprocesses
    assert default_cache_dir().parent == isolated_cache_dir
    assert plancache._path("k").parents[1] == isolated_cache_dir

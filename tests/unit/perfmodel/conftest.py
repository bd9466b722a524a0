import pytest

from powerfusion import options
from powerfusion.pipeline import plancache


@pytest.fixture()
def cache(tmp_path):
    """A fresh plan cache (memory and disk) for one test."""
    plancache.clear_memo()
    with options.context(cache_dir=tmp_path):
        yield tmp_path
    plancache.clear_memo()

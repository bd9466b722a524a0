"""The compile pipeline around the core: `pipeline.compile` (driver.py, the one driver), the
plan choice and search, plan cache, tuning and plan files."""


def __getattr__(name):
    # `pipeline.compile(...)` without importing the whole pipeline with the package (plancache
    # and search are imported from here by modules the pipeline itself imports)
    if name == "compile":
        from powerfusion.pipeline.driver import compile
        return compile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The compile pipeline around the core: plan search, plan cache, tuning and plan files."""

"""Stored calibrations (JSON per target key), applied by specs.get_target."""

"""Target hardware: specs (memory levels, limits, backend name) and measured calibration."""

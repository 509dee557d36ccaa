"""LoopQ calibration callbacks (adaptive mu_t, sharing-gap reselection, per-loop diagnostics)."""

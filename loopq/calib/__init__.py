"""LoopQ calibration: the LightningModule, the trajectory-aware loss, teacher targets, student IO."""

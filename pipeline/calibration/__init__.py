"""Real-to-sim calibration: fit the twin's randomized physical scales, latency and observation noise to
the plant's own shadow logs (`sim2real calibrate`), and the `calibrated` randomization set it writes."""

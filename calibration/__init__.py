"""Offline calibration of OSCAR rotations and clip ratios, and quality evaluation."""

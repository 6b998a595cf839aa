"""Density schedules (warm-up, critical regimes, density="auto") and the compression monitor."""

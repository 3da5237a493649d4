"""Reports: plots of per-rank timelines and speedups (matplotlib, headless)."""

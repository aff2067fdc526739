"""Estimators: the memory of a step, traced from step/ (cached, or from shipped templates), and its compute.
Pure functions; torch is imported only where a trace runs."""

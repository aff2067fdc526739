"""Estimators: model shape, memory, compute. Pure functions; torch is imported only where needed."""

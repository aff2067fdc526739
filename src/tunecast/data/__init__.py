"""Datasets: read, detect the format, tokenize, measure, pack."""

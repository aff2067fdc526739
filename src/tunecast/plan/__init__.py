"""Planning: throughput, run time, the cost of the whole run per offer, ranking, rent versus buy; and what measures
for it on the real device: the probe (probe.py, the figures the throughput model uses) and calibrate (a short run of
the real training loop, train/, whose measured speed a plan then uses). Those two import torch when they run."""

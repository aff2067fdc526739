"""Planning: throughput, run time, the cost of the whole run per offer, ranking, rent versus buy; and calibrate, a
short run of the real training loop (train/) whose measured speed the plan then uses."""

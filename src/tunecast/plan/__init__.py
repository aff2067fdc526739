"""Planning: throughput, run time, the cost of the whole run per offer, ranking, rent versus buy."""

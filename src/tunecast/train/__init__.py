"""Training: runs step/ in a loop with checkpoints on storage/, resumes exactly, stops cleanly on preemption;
probe and calibrate measure the hardware for plan/. Imports torch; never imported by light commands."""

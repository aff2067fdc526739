"""Training: runs step/ in a loop with checkpoints on storage/, resumes exactly, stops cleanly on preemption. The
loop imports torch: only commands that train or measure import it (policy.py and steady.py, which plan/ reads,
import none)."""

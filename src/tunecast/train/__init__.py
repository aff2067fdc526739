"""Training: model setup, loss, loop, state, checkpoints. Imports torch; never imported by light commands."""

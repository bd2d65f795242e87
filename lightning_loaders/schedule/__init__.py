"""Schedules: the plan of every epoch (which positions each rank and worker reads in which
batch), the cursor, epoch ownership against the trainer, and the saved state."""

"""ddpbus.worker_agent: one agent per GPU that trains the slices the coordinator hands out."""

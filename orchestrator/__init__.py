"""ddpbus.orchestrator: the coordinator side (schedule, membership, recovery) and the CLI.

Never touches tensors and never imports torch.distributed.
"""

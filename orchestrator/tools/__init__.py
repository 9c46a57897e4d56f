"""The operator's side: the ``ddpbus`` command line, the local launcher and the tools that
read a job (sub, status, replay, simulate, delete-job).
"""

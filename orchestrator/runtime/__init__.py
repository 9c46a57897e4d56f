"""The processes' shells: the coordinator service, the embedded nats-server, provisioning,
the broker backend's reducer, retention, metrics and supervised tasks.
"""

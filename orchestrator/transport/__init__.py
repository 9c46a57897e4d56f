"""The NATS connection: connecting, publishing with retries, the job's logins.

Above the core, below everything that stores or serves.
"""

"""What a job keeps in JetStream for its coordinator: snapshots, the journal, the
leader lease, resume bundles and the recorded stream.
"""

"""What nodes tell the user and each other about themselves and the job: the status board each node
publishes, its record's schema, `rally status`'s reader, the job's notes about its nodes (failures,
quarantine, learned timeouts, the pre-flight verdict) and the lines a waiting node says.

It stands on base/ only, so the stores (c10d/, etcd/) can say what their long waits wait for, and `rally
status` reads a job without importing the round protocol.
"""

"""Bad nodes never join: quarantine of a node that keeps failing the job, and the
pre-flight check (a compute and collective probe, run as a process of its own) when a round forms."""

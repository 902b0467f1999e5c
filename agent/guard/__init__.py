"""No process left behind: starting workers in their own process groups, stopping them (a
signal, one grace period, SIGKILL of every descendant), the job's cgroup, and the orphan guard,
a standard-library process that outlives the agent and kills whatever the job started when the
agent dies."""

"""The orphan guard: a standard-library process that outlives the agent and kills
whatever the job started when the agent dies, and the agent's end of its pipe."""

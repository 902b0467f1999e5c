"""Code that runs inside the workers, not in the agent: the public `rally.job` helper, the
bootstrap that starts a script (and the template process), the heartbeat file a worker writes
and the preemption flag. Standard library only at import time: a worker must not pay for rally."""

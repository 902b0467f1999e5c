"""Code that runs inside the workers and the template they are forked from: the
public `rally.job` helper, the bootstrap that starts a script, the files a worker writes for
its agent (checkpoints, heartbeats) and the template server. Standard library only at import
time: a worker must not pay for rally."""

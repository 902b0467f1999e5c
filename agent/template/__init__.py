"""Fast restarts: the worker template, one room for both of its ends. The agent's side
(`client`, `connection`) starts the template and asks it for workers; the template's side
(`server`, run by worker_side/bootstrap.py in the template process) preloads torch and forks
them; `wire` is the protocol between the two."""

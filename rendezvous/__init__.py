"""The rendezvous: the round protocol agents form a job with, the backend registry that plans and opens its
store, and how one node finds the others.

Its rooms, bottom up (tests/support/package_graph.py's `RENDEZVOUS_LAYERS`): base/ (the store interface, token,
records, membership arithmetic), status/ (what nodes say about themselves), c10d/ and etcd/ (the stores),
and this root: forming a round (protocol.py, arrival.py), a formed round's channel, liveness, the
hang-stack exchange and the preemption barrier, the backend registry (backends.py) and the plan (plan.py).
"""

"""What the tests share, one module each: starting rally and polling (helpers.py), agents on one
machine (agents.py), a running rally to talk to (live_rally.py), the other user (stranger.py,
stranger_store.py), real clusters (etcd_cluster.py, slurm_cluster.py), the session's reference
runs (ddp_reference.py, fsdp_reference.py, once_per_run.py) and the house's code readers
(package_graph.py, bare_any.py). Test modules import them as `from support.helpers import ...`;
tests/conftest.py loads the fixtures' plugins."""

"""The per-node agent: spawns workers, watches them, and restarts the job through the rendezvous.

The agent itself (agent.py, decide.py, report.py, ...) sits on rooms that are layers, each
importing only those below it (tests/test_import_graph.py keeps it so; docs/architecture.md
draws it): base, display < checkpoint, guard < template < worker_side < observe < rounds <
checks < the agent.
"""

"""Rendering shared by the launcher and the agent (console lines, the worker
table). A leaf: it imports nothing of rally, so either side may use it."""

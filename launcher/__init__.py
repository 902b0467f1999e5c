"""rally's command line: parses torchrun-compatible flags, config files and SLURM, then runs the agent."""

__version__ = "0.1.0"

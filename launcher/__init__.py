"""rally's command line: parses torchrun-compatible flags, config files and SLURM, then runs the agent."""

# The one place the version is written: `rally.__version__` and pyproject.toml read it from here.
__version__ = "0.1.0"

"""Option checking, one room with its errors: every check of a user's input before anything starts, each
failure one line (`ConfigError`, exit 2) or all of a run's at once (`Mistakes`).

`validate.py` holds the errors and the checks of raw input at the edge (paths, the entry point, signals),
`option_checks.py` the checks launcher/options.py names (one signature each), `values.py` the parsers of
values written as text (--rdzv-conf, seconds, nproc), `worker_flags.py` those of the flags that shape
each worker, `preload.py` the --preload list, and `path_checks.py` the paths the job writes through or
reads a secret from (rendezvous/base/path_trust.py's rule). Nothing here imports the rest of the launcher.
"""

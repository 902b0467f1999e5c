"""`dlrover-run` for torch 2.13: DLRover 0.6.1 builds torch's SubprocessHandler without the
`numa_options` argument that torch 2.13 added, so it cannot start. This gives the argument its
natural default (None, no NUMA binding) and runs dlrover-run's own main; nothing else changes.

    python bench/shim/dlrover_run.py --standalone --nproc_per_node 2 script.py
"""

import functools
import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

_init = subprocess_handler.SubprocessHandler.__init__


@functools.wraps(_init)
def _init_with_default(self, entrypoint, args, env, stdout, stderr, local_rank_id=0, numa_options=None):
    _init(self, entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)


subprocess_handler.SubprocessHandler.__init__ = _init_with_default

from dlrover.trainer.torch.elastic_run import main  # noqa: E402

sys.exit(main())

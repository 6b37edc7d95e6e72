"""python -m echospec.services.coordinator --model PATH [--port P] [--spec] [--verifier-target H:P]
[--draft-target H:P] (env ECHOSPEC_*)."""
# numpy is only used for buffers here; its OpenBLAS worker threads would spin on the
# cores the engine computes on, so keep OpenBLAS to one thread (before numpy loads).
import os
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from echospec.services.common.lifecycle import exit_with_parent  # noqa: E402
exit_with_parent()   # first: a child of `echospec serve --processes` never outlives it

import sys

from echospec.services.common import config as cfg
from echospec.services.common import logs
from echospec.services.common.grpc_util import PortInUseError
from echospec.services.coordinator.server import serve


def main(argv=None) -> int:
    conf = cfg.load(cfg.CoordinatorConfig, argv, prog="python -m echospec.services.coordinator")
    try:
        logs.setup(conf.log_level, conf.log_format)
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    if not conf.model:
        print("coordinator: no model (--model PATH or ECHOSPEC_MODEL)", file=sys.stderr)
        return 2
    try:
        serve(conf)
    except (PortInUseError, TimeoutError, ValueError, FileNotFoundError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m echospec.services.coordinator --model PATH [--port P] [--spec] [--verifier-target H:P]
[--draft-target H:P] (env ECHOSPEC_*)."""
# numpy is only used for buffers here; its OpenBLAS worker threads would spin on the
# cores the engine computes on, so keep OpenBLAS to one thread (before numpy loads).
import os
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from echospec.services.rpc.lifecycle import exit_with_parent  # noqa: E402
exit_with_parent()   # first: a child of `echospec serve --processes` never outlives it

import sys  # noqa: E402

from echospec.services.common import config as cfg  # noqa: E402
from echospec.services.rpc.lifecycle import service_main  # noqa: E402
from echospec.services.rpc.grpc_util import PortInUseError  # noqa: E402
from echospec.services.coordinator.server import serve  # noqa: E402


def main(argv=None) -> int:
    return service_main("coordinator", cfg.CoordinatorConfig, serve, argv,
                        (PortInUseError, TimeoutError, ValueError, FileNotFoundError), needs_model=True)


if __name__ == "__main__":
    sys.exit(main())

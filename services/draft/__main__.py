"""python -m echospec.services.draft [--port P] [--host H] [--min-n N] (env ECHOSPEC_*)."""
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
from echospec.services.draft.proposer import ProposerError, check_min_n  # noqa: E402
from echospec.services.draft.server import serve  # noqa: E402


def _check(conf: cfg.DraftConfig) -> None:
    """min_n (--min-n) as a bad setting: ValueError naming it."""
    try:
        check_min_n(conf.min_n)
    except ProposerError as exc:
        raise ValueError(f"--min-n / ECHOSPEC_MIN_N: {exc}") from None


def main(argv=None) -> int:
    return service_main("draft", cfg.DraftConfig, serve, argv,
                        (PortInUseError, ProposerError, ValueError), check=_check)


if __name__ == "__main__":
    sys.exit(main())

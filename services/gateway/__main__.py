"""python -m echospec.services.gateway [--port P] [--coordinator-target H:P] [--api-key K]
[--tls-cert F --tls-key F] (env ECHOSPEC_*; the key is best given as ECHOSPEC_API_KEY)."""
from echospec.services.rpc.lifecycle import exit_with_parent
exit_with_parent()   # first: a child of `echospec serve --processes` never outlives it

import sys  # noqa: E402

from echospec.services.common import config as cfg  # noqa: E402
from echospec.services.rpc.lifecycle import service_main  # noqa: E402
from echospec.services.rpc.grpc_util import PortInUseError  # noqa: E402
from echospec.services.gateway.server import serve  # noqa: E402


def main(argv=None) -> int:
    return service_main("gateway", cfg.GatewayConfig, serve, argv,
                        (PortInUseError, ValueError))


if __name__ == "__main__":
    sys.exit(main())

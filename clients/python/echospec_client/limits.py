"""Limits of the echospec.v1 wire that the client and the services both check: one copy of each.

It lives in the light client (echospec_client, its own distribution) because the client must not
import the services; the services import it from here (the echospec distribution installs
echospec_client too, see pyproject.toml's package-dir).
"""
from __future__ import annotations

# The wire's temperature, top_p and min_p are float32: larger finite values would arrive as inf.
FLOAT32_MAX = 3.4028234663852886e38

# The wire's int32 fields (max_tokens, top_k, k, token ids) and the uint64 seed.
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
UINT64_MAX = 2 ** 64 - 1

# An x-request-id the coordinator and the gateway take (printable ASCII); for longer ones, or none,
# the coordinator makes its own.
MAX_REQUEST_ID = 64

# gRPC target URIs (dns:///name:port, unix:path, ...): not host:port, so their port is gRPC's to check.
GRPC_URI_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")

# The most alternatives a request may ask for with each token's logprob (top_logprobs, OpenAI's
# limit); the verifier, the coordinator, the gateway and the client check it.
MAX_TOP_LOGPROBS = 20

# The most draft nodes a token-tree round verifies (tree_nodes): the engine's ES_MAX_TREE_NODES (64)
# less the round's pending token, its root.
MAX_TREE_DRAFT_NODES = 63

# repeat_penalty's range (1: off): llama.cpp divides a repeated token's positive logit by it and
# multiplies a negative one, so a tiny or huge value would overflow the logits to infinity.
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-3, 1e3

# The longest API or internal key: well under gRPC's metadata limit (16 KiB); the services refuse a
# longer one at start, the client before any call.
MAX_KEY_CHARS = 4096

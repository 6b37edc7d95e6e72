"""The light Python client of echospec: the coordinator's gRPC stubs (echospec_client.v1)
and `Client` with typed results. Needs only grpcio and protobuf; no engine, no compiler."""
from echospec_client.client import (API_KEY_ENV, DEFAULT_TARGET, Chunk, Client, ClientError,
                                    ConnectError, Info, Message, Move, Result, SpecStats,
                                    TokenLogprob, ToolCall, TopLogprob, image_part)

__all__ = ["API_KEY_ENV", "DEFAULT_TARGET", "Chunk", "Client", "ClientError", "ConnectError",
           "Info", "Message", "Move", "Result", "SpecStats", "TokenLogprob", "ToolCall",
           "TopLogprob", "image_part"]
__version__ = "0.1.0"

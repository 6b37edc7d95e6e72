"""The coordinator's clients of the verifier (grpcio's public API only).

``GenerationLink`` is the generation path: one server-streaming
GenerateTokens call per generation; the verifier runs the loop and streams
one message per engine step. Cancelling the call ends the generation at the
verifier (stop string, client gone, deadline).

``VerifierLink`` drives a VerifyStream session step by step (a round trip
per step); tools/perf/round_overhead.py measures it against the loop in the verifier.
"""
from __future__ import annotations

from typing import Any, Iterator

import grpc

from echospec.services.rpc.streams import BidiStream


class VerifierFailure(Exception):
    """The verifier refused or failed a request: ``code`` is the grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, details: str):
        # "verifier: " names the source, unless the details already start by naming the verifier
        super().__init__(details if details.startswith("verifier ") else f"verifier: {details}")
        self.code = code
        self.details = details


def _verifier_failure(exc: grpc.RpcError) -> VerifierFailure:
    return VerifierFailure(exc.code(), exc.details() or str(exc.code()))


class GenerationLink:
    """One GenerateTokens call.

    Args:
        stub: VerifierServiceStub. request: GenerateTokensRequest.
        timeout: the generation's deadline in seconds (None: none).
    """

    def __init__(self, stub: Any, request: Any, timeout: float | None):
        self.cancelled = False   # cancel() was called: a CANCELLED status is ours, not the verifier's
        self._call = stub.GenerateTokens(request, timeout=timeout)

    def events(self) -> Iterator[Any]:
        """The GenerateTokensResponse messages as they arrive.

        Raises:
            VerifierFailure: the verifier's status (e.g. INVALID_ARGUMENT for a
                prompt that does not fit the context).
        """
        try:
            yield from self._call
        except grpc.RpcError as exc:
            raise _verifier_failure(exc) from None

    def cancel(self) -> None:
        """End the generation at the verifier (any thread; idempotent)."""
        self.cancelled = True
        self._call.cancel()


class VerifierLink:
    """One verifier session over a VerifyStream (a round trip per step).

    Args:
        stub: VerifierServiceStub. timeout: the session's deadline in seconds.
    """

    def __init__(self, stub: Any, timeout: float | None):
        from echospec.v1 import verifier_pb2
        self._pb = verifier_pb2
        self._stream = BidiStream(stub.VerifyStream, timeout)

    def prefill(self, tokens: list[int], sampling: Any) -> Any:
        """Prefill the prompt; returns the StepResult (tokens = [first token]). Raises VerifierFailure."""
        self._stream.send(self._pb.VerifyStreamRequest(
            prefill=self._pb.PrefillRequest(tokens=tokens, sampling=sampling)))
        return self._recv()

    def step(self, draft: list[int]) -> Any:
        """Verify ``draft`` (K = 0: decode); returns the StepResult. Raises VerifierFailure."""
        self._stream.send(self._pb.VerifyStreamRequest(step=self._pb.VerifyRequest(draft=draft)))
        return self._recv()

    def _recv(self) -> Any:
        try:
            return self._stream.recv().result
        except grpc.RpcError as exc:
            raise _verifier_failure(exc) from None
        except StopIteration:
            raise VerifierFailure(grpc.StatusCode.INTERNAL, "the verifier ended the stream") from None

    def close(self) -> None:
        self._stream.close()

    def cancel(self) -> None:
        self._stream.cancel()

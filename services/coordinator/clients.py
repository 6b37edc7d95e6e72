"""The coordinator's clients of the verifier (grpcio's public API only).

``GenerationLink`` is the generation path: one server-streaming
GenerateTokens call per generation; the verifier runs the loop and streams
one message per engine step. Cancelling the call ends the generation at the
verifier (stop string, client gone, deadline).
"""
from __future__ import annotations

from typing import Any, Iterator

import grpc


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
        self.stalled = ""        # stall(why) was called: the verifier missed its progress deadline
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

    def stall(self, why: str) -> None:
        """End the call because the verifier missed its progress deadline (any thread): the
        reader's CANCELLED is then the stall's, said in ``stalled``, not the caller's cancel."""
        if not self.cancelled and not self.stalled:
            self.stalled = why
            self._call.cancel()

"""DraftService servicer: proto <-> NgramProposer, proposer errors -> INVALID_ARGUMENT."""
from __future__ import annotations

import logging
import threading
from typing import Iterator

import grpc

from echospec.v1 import draft_pb2, draft_pb2_grpc
from echospec.services.common.config import DraftConfig
from echospec.services.draft.proposer import MAX_K_LIMIT, NgramParams, NgramProposer, ProposerError, propose_once

log = logging.getLogger("echospec.draft")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Serves ProposeStream (one proposer per stream) and stateless Propose.

    Args:
        config: n-gram defaults (min_n, max_n).
    """

    def __init__(self, config: DraftConfig):
        self.config = config
        self._lock = threading.Lock()
        self.active_sessions = 0
        self.total_sessions = 0

    def _params(self, min_n: int, max_n: int) -> NgramParams:
        return NgramParams(min_n or self.config.min_n, max_n or self.config.max_n).validate()

    def ProposeStream(self, request_iterator: Iterator[draft_pb2.ProposeStreamRequest],
                      context: grpc.ServicerContext) -> Iterator[draft_pb2.ProposeStreamResponse]:
        """The stream is the session: its history lives until the stream ends."""
        with self._lock:
            self.active_sessions += 1
            self.total_sessions += 1
        proposer: NgramProposer | None = None
        try:
            for req in request_iterator:
                try:
                    if proposer is None:
                        proposer = NgramProposer(self._params(req.min_n, req.max_n))
                    proposer.append(req.append)
                    if req.k < 0 or req.k > MAX_K_LIMIT:
                        raise ProposerError(f"k must be in [0, {MAX_K_LIMIT}], got {req.k}")
                    if req.k == 0:
                        continue
                    draft, n = proposer.propose(req.k)
                except ProposerError as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                yield draft_pb2.ProposeStreamResponse(draft=draft, matched_n=n,
                                                      history_len=len(proposer))
        finally:
            with self._lock:
                self.active_sessions -= 1

    def Propose(self, request: draft_pb2.ProposeRequest,
                context: grpc.ServicerContext) -> draft_pb2.ProposeResponse:
        if request.k < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"k must be >= 1, got {request.k}")
        try:
            draft, n = propose_once(list(request.tokens), request.k,
                                    self._params(request.min_n, request.max_n))
        except ProposerError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return draft_pb2.ProposeResponse(draft=draft, matched_n=n)

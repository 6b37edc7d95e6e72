"""DraftService servicer: proto <-> DraftProposer, proposer errors -> INVALID_ARGUMENT."""
from __future__ import annotations

import logging
import threading
from typing import Iterator

import grpc

from echospec.v1 import draft_pb2, draft_pb2_grpc
from echospec.services.common.config import DraftConfig
from echospec.services.draft.memory import SharedMemory, namespace_problem
from echospec.services.draft.proposer import (MAX_K_LIMIT, DraftParams, DraftProposer, ProposerError,
                                              check_min_n)
from echospec.services.draft.suffix_index import SuffixParams

log = logging.getLogger("echospec.draft")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Serves ProposeStream (one DraftProposer per stream) and stateless Propose.

    Args:
        config: defaults (min_n: the shortest match the suffix index drafts from)
            and the shared memory's bounds.
    """

    def __init__(self, config: DraftConfig):
        self.config = config
        self._lock = threading.Lock()
        self.active_sessions = 0
        self.total_sessions = 0
        self.memory = SharedMemory(config.shared_max_tokens, config.shared_max_namespaces)

    def _params(self, min_n: int) -> DraftParams:
        """A session's settings: the request's min_n (0: the server's). Raises ProposerError."""
        return DraftParams(suffix=SuffixParams(min_match=check_min_n(min_n or self.config.min_n)))

    def ProposeStream(self, request_iterator: Iterator[draft_pb2.ProposeStreamRequest],
                      context: grpc.ServicerContext) -> Iterator[draft_pb2.ProposeStreamResponse]:
        """The stream is the session: its history lives until the stream ends, then goes to
        its namespace's shared memory (none without a namespace)."""
        with self._lock:
            self.active_sessions += 1
            self.total_sessions += 1
        proposer: DraftProposer | None = None
        try:
            held = 0   # tokens of the session: history + prediction (config.max_history)
            for req in request_iterator:
                held += len(req.append) + len(req.prediction)
                if held > self.config.max_history:
                    proposer = None    # an ended stream is not remembered
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"the draft session would hold {held} tokens (history and "
                                  f"prediction), more than the draft service's max_history "
                                  f"{self.config.max_history}")
                try:
                    if proposer is None:
                        if len(req.digit_tokens) not in (0, 10):
                            raise ProposerError(f"digit_tokens must hold 0 or 10 ids, got "
                                                f"{len(req.digit_tokens)}")
                        if namespace_problem(req.draft_namespace):
                            raise ProposerError(namespace_problem(req.draft_namespace))
                        proposer = DraftProposer(self._params(req.min_n), list(req.prediction),
                                                 list(req.digit_tokens), self.memory,
                                                 req.draft_namespace, list(req.line_break_tokens))
                        proposer.append(req.append)
                        proposer.start_output()
                    else:
                        proposer.append(req.append)
                    if req.k < 0 or req.k > MAX_K_LIMIT:
                        raise ProposerError(f"k must be in [0, {MAX_K_LIMIT}], got {req.k}")
                    if req.k == 0:
                        continue
                    parents: list[int] = []
                    node_sources: list[int] = []
                    if req.tree_nodes:
                        draft, parents, node_sources, n, source = proposer.propose_tree_sources(
                            req.k, req.tree_nodes)
                    else:
                        draft, n, source = proposer.propose(req.k)
                except ProposerError as exc:
                    proposer = None    # a refused stream is not remembered
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                yield draft_pb2.ProposeStreamResponse(draft=draft, matched_n=n,
                                                      history_len=len(proposer), source=source,
                                                      parents=parents, node_sources=node_sources)
        finally:
            with self._lock:
                self.active_sessions -= 1
            if proposer is not None:
                proposer.remember()

    def Propose(self, request: draft_pb2.ProposeRequest,
                context: grpc.ServicerContext) -> draft_pb2.ProposeResponse:
        """The suffix index over ``tokens`` alone (no prediction, no shared memory)."""
        if not 1 <= request.k <= MAX_K_LIMIT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"k must be in [1, {MAX_K_LIMIT}], got {request.k}")
        if len(request.tokens) > self.config.max_history:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{len(request.tokens)} tokens, more than the draft service's max_history "
                          f"{self.config.max_history}")
        try:
            p = DraftProposer(self._params(request.min_n))
            p.append(list(request.tokens))
            parents: list[int] = []
            node_sources: list[int] = []
            if request.tree_nodes:
                draft, parents, node_sources, n, _ = p.propose_tree_sources(request.k, request.tree_nodes)
            else:
                draft, n, _ = p.propose(request.k)
        except ProposerError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return draft_pb2.ProposeResponse(draft=draft, matched_n=n, parents=parents,
                                         node_sources=node_sources)

"""The verifier's client of the draft service: one ProposeStream per speculative generation.

Fed incrementally: each request appends the tokens added since the previous
one. ``send_propose`` starts a proposal without waiting (the engine computes
meanwhile); ``recv_proposal`` collects it. At most one proposal is in flight.
"""
from __future__ import annotations

import time
from typing import Any

import grpc

from echospec.v1 import draft_pb2
from echospec.services.rpc.streams import BidiStream
from echospec.services.verifier.generation_loop import DraftUnavailable
from echospec.services.verifier.tree_accept import first_branch


# seconds a proposal may take before the draft service counts as gone for the generation (it
# answers in well under a millisecond; the first answer of a long prompt's session in a fraction
# of a second): decoding then carries on plainly instead of waiting on a stuck service
REPLY_TIMEOUT_S = 10.0
# seconds a proposal may take once a proposal from the same draft service did not come, until one
# does again: a stuck service (SIGSTOP, a peer that takes the connection and never answers) costs
# each new generation this, not REPLY_TIMEOUT_S (a 32k-token prompt's first answer takes ~30 ms)
STALLED_REPLY_TIMEOUT_S = 1.0
# of the time left to a generation's deadline, the share a proposal may take: a stuck draft service
# then leaves the rest to plain decoding instead of the whole deadline passing in the wait
DEADLINE_SHARE = 0.5


# statuses by which a draft service that answered refused the session (not a service gone)
_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.FAILED_PRECONDITION)


class ReplyTimeout:
    """The reply timeout the links to one draft service share (thread-safe: one flag).

    ``seconds`` is ``normal`` while the service answers; after a link's proposal did not come
    (``missed``) it is ``stalled`` until a link receives a proposal again (``answered``).
    """

    def __init__(self, normal: float = REPLY_TIMEOUT_S, stalled: float = STALLED_REPLY_TIMEOUT_S):
        self.normal, self.stalled = normal, stalled
        self.is_stalled = False

    @property
    def seconds(self) -> float:
        return self.stalled if self.is_stalled else self.normal

    def answered(self) -> None:
        self.is_stalled = False

    def missed(self) -> None:
        self.is_stalled = True


class DraftLink:
    """One draft session over a ProposeStream (grpcio's public stream API).

    Args:
        stub: DraftServiceStub. timeout: the generation's deadline in seconds (None: none).
        tls_mismatch: a grpc_util.TlsMismatch of the draft target, or None: an unreachable
            draft service is then reported with the likely cause when TLS is on one side only.
        reply_timeout: seconds a proposal may take (REPLY_TIMEOUT_S), or the ReplyTimeout shared
            by the links to this draft service; never more than DEADLINE_SHARE of the time left
            to the deadline.
        n_vocab: the verifier's vocabulary size: a proposal holding an id outside [0, n_vocab)
            (another model's, through a namespace it shares) ends the link (0: not checked).
    """

    def __init__(self, stub: Any, timeout: float | None, min_n: int = 0,
                 prediction: list[int] | None = None, digit_tokens: list[int] | None = None,
                 draft_namespace: str = "", line_break_tokens: list[int] | None = None,
                 tls_mismatch: Any = None,
                 reply_timeout: float | ReplyTimeout = REPLY_TIMEOUT_S, n_vocab: int = 0):
        self._tls_mismatch = tls_mismatch
        self._reply = reply_timeout if isinstance(reply_timeout, ReplyTimeout) else \
            ReplyTimeout(reply_timeout, reply_timeout)
        self._n_vocab = n_vocab
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._stream = BidiStream(stub.ProposeStream, timeout)
        self._first = True
        self._min_n = min_n
        self._setup = dict(prediction=prediction or [], digit_tokens=digit_tokens or [],
                           draft_namespace=draft_namespace, line_break_tokens=line_break_tokens or [])
        self.last_source = 0   # echospec.v1.DraftSource of the last proposal received
        # token trees: other nodes asked for beside each proposal's chain (0: chains only), and
        # the last proposal's tree (tokens, parents, node sources), None for a chain
        self.tree_nodes = 0
        self.last_tree: tuple[list[int], list[int], list[int]] | None = None

    def _msg(self, append: list[int], k: int) -> draft_pb2.ProposeStreamRequest:
        m = draft_pb2.ProposeStreamRequest(append=append, k=k)
        if k and self.tree_nodes:
            m.tree_nodes = k + self.tree_nodes
        if self._first:   # the session's setup; its append is the prompt
            m.min_n = self._min_n
            m.prediction.extend(self._setup["prediction"])
            m.digit_tokens.extend(self._setup["digit_tokens"])
            m.draft_namespace = self._setup["draft_namespace"]
            m.line_break_tokens.extend(self._setup["line_break_tokens"])
            self._first = False
        return m

    def append(self, tokens: list[int]) -> None:
        """Append tokens to the draft history (no response, non-blocking)."""
        self._stream.send(self._msg(tokens, 0))

    def send_propose(self, append: list[int], n: int) -> None:
        """Append ``append`` and ask for up to n tokens (non-blocking)."""
        self._stream.send(self._msg(append, n))

    def ready(self, wait: float = 0.0) -> bool:
        """The proposal asked for has come, or comes within ``wait`` seconds (or the stream
        ended): ``recv_proposal`` will not wait."""
        return self._stream.poll(wait)

    def recv_proposal(self) -> list[int]:
        """The proposal asked for by the last ``send_propose`` (its source: ``last_source``): the
        chain, a tree's first branch (the tree: ``last_tree``).

        Raises:
            DraftUnavailable: the stream failed (service down, refused, ended), the proposal
                did not come within the reply timeout, or it holds an id outside the vocabulary.
        """
        wait_s = full_s = self._reply.seconds
        if self._deadline is not None:
            wait_s = min(full_s, max(0.0, self._deadline - time.monotonic()) * DEADLINE_SHARE)
        try:
            resp = self._stream.recv(wait_s)
            self._reply.answered()
            if self._n_vocab and resp.draft and (min(resp.draft) < 0 or max(resp.draft) >= self._n_vocab):
                bad = next(t for t in resp.draft if not 0 <= t < self._n_vocab)
                raise DraftUnavailable(f"draft service proposed token {bad}, outside the vocabulary "
                                       f"[0, {self._n_vocab})")
            self.last_source = resp.source
            if resp.parents:
                # node sources: an older draft service sends none (every node: the chain's source)
                srcs = list(resp.node_sources) if len(resp.node_sources) == len(resp.draft) \
                    else [resp.source] * len(resp.draft)
                self.last_tree = (list(resp.draft), list(resp.parents), srcs)
                return first_branch(resp.draft, resp.parents)
            self.last_tree = None
            return list(resp.draft)
        except grpc.RpcError as exc:
            hint = self._tls_mismatch.hint(exc.code()) if self._tls_mismatch is not None else ""
            # refused for its credential (the internal key), or the session for what it holds
            # (too long a history): reached, but not served
            code = exc.code()
            what = ("draft service refused this verifier" if code == grpc.StatusCode.UNAUTHENTICATED
                    else "draft service refused the session" if code in _REFUSALS
                    else "draft service unreachable")
            raise DraftUnavailable(f"{what} ({hint + '; ' if hint else ''}"
                                   f"{exc.code().name}: {exc.details()})") from None
        except StopIteration:
            raise DraftUnavailable("draft service ended the stream") from None
        except TimeoutError:
            if wait_s >= full_s:   # a wait cut short by the deadline says nothing of the service
                self._reply.missed()
            raise DraftUnavailable(f"draft service did not answer within {wait_s:.3g} s") from None

    def close(self) -> None:
        self._stream.close()

    def cancel(self) -> None:
        self._stream.cancel()

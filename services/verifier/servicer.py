"""VerifierService servicer: proto <-> VerifierCore; VerifierError kinds -> status codes.

A bad request aborts only its own RPC (and frees only its own stream's
session); the service and other sessions carry on.
"""
from __future__ import annotations

import logging
from typing import Iterator

import grpc

from echospec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from echospec.services.common.engine import simd_name
from echospec.services.verifier.sessions import (FailedPrecondition, Sampling, StepOutcome, VerifierCore,
                                        VerifierError, VerifierSession)

log = logging.getLogger("echospec.verifier")


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    """SamplingParams -> Sampling (top_p <= 0 or >= 1 reads as off)."""
    top_p = p.top_p if 0.0 < p.top_p < 1.0 else 1.0
    return Sampling(temperature=p.temperature, top_k=p.top_k, top_p=top_p, min_p=p.min_p, seed=p.seed)


def result_to_proto(out: StepOutcome) -> verifier_pb2.StepResult:
    return verifier_pb2.StepResult(
        tokens=out.tokens, k=out.k, accepted=out.accepted, tries=1 if out.k >= 1 else 0,
        hits=out.accepted, kv_rolls=out.kv_rolls, t_ms=out.t_ms, v_ms=out.v_ms,
        n_past=out.n_past, n_ctx=out.n_ctx)


def _abort(context: grpc.ServicerContext, exc: VerifierError):
    context.abort(getattr(grpc.StatusCode, exc.kind), exc.message)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    """Thin servicer over a VerifierCore (None until the model is loaded and warm)."""

    def __init__(self, core: VerifierCore | None = None):
        self.core = core

    def _core(self, context: grpc.ServicerContext) -> VerifierCore:
        core = self.core
        if core is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        return core

    def GetConfig(self, request, context):
        core = self._core(context)
        cfg = core.config
        return verifier_pb2.GetConfigResponse(
            model=cfg.model, arch=core.model.info.arch, n_vocab=core.n_vocab, n_ctx=cfg.n_ctx,
            n_threads=cfg.n_threads, batch_max=1, kv_eviction="none", sparse_attention=False,
            max_k=cfg.max_k, t_ms=core.t_ms, simd=simd_name(),
            active_sessions=core.active_sessions)

    def VerifyStream(self, request_iterator: Iterator[verifier_pb2.VerifyStreamRequest],
                     context: grpc.ServicerContext) -> Iterator[verifier_pb2.VerifyStreamResponse]:
        """First request: prefill (opens the session); then one step per request.

        The session is freed when the stream ends, fails, is cancelled or its
        deadline passes (the termination callback and the finally both close it).
        """
        core = self._core(context)
        holder: list[VerifierSession] = []

        def _free() -> None:
            for s in holder:
                s.close()

        context.add_callback(_free)
        try:
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if not holder:
                    if kind != "prefill":
                        raise FailedPrecondition("the first message of a VerifyStream must be prefill")
                    holder.append(core.open(sampling_from_proto(req.prefill.sampling), named=False))
                    if not context.is_active():
                        return
                    out = holder[0].prefill(req.prefill.tokens)
                else:
                    if kind != "step":
                        raise FailedPrecondition("only step messages may follow the prefill")
                    out = holder[0].step(req.step.draft)
                yield verifier_pb2.VerifyStreamResponse(result=result_to_proto(out))
        except VerifierError as exc:
            _abort(context, exc)
        finally:
            _free()

    def CreateSession(self, request, context):
        core = self._core(context)
        try:
            s = core.open(sampling_from_proto(request.sampling), named=True)
        except VerifierError as exc:
            _abort(context, exc)
        return verifier_pb2.CreateSessionResponse(session_id=s.sid, n_ctx=s.n_ctx)

    def Prefill(self, request, context):
        core = self._core(context)
        try:
            out = core.get(request.session_id).prefill(request.tokens)
        except VerifierError as exc:
            _abort(context, exc)
        return verifier_pb2.PrefillResponse(result=result_to_proto(out))

    def Verify(self, request, context):
        core = self._core(context)
        try:
            out = core.get(request.session_id).step(request.draft)
        except VerifierError as exc:
            _abort(context, exc)
        return verifier_pb2.VerifyResponse(result=result_to_proto(out))

    def Decode(self, request, context):
        core = self._core(context)
        try:
            out = core.get(request.session_id).step([])
        except VerifierError as exc:
            _abort(context, exc)
        return verifier_pb2.DecodeResponse(result=result_to_proto(out))

    def CloseSession(self, request, context):
        core = self._core(context)
        try:
            core.get(request.session_id).close()
        except VerifierError as exc:
            _abort(context, exc)
        return verifier_pb2.CloseSessionResponse()

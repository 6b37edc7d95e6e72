"""Speculation gating: a pure function of the request, the server default and
the verifier's capabilities.

Speculation runs only when every rule holds:
    the request asks for it (SPEC_MODE_ON), or leaves it unspecified and the
        server runs with --spec;
    temperature <= 0, top_p >= 1, min_p <= 0 (greedy: the accept rule compares
        drafts with the argmax, so sampling would change the output);
    the verifier keeps every KV position (kv_eviction == "none"), uses full
        attention (sparse_attention false) and does not batch requests into one
        forward (batch_max < 2): each of these could make a verify over K + 1
        tokens differ from K + 1 decode steps.
Each refusal is reported as a reason string; all violated rules are listed.
Not a rule: a grammar and repetition penalties keep speculation on, because the verifier
checks each drafted position against the token of its own (masked, penalised) logits row,
whose penalty counts are those of the row's own prefix, so the output stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from echospec.v1.common_pb2 import SpecMode
from echospec.services.common.floats import f32_str

MODE_UNSPECIFIED, MODE_OFF, MODE_ON = (SpecMode.Value(f"SPEC_MODE_{m}") for m in ("UNSPECIFIED", "OFF", "ON"))


@dataclass(frozen=True)
class VerifierCaps:
    """What the verifier reports in GetConfig that matters for gating."""

    kv_eviction: str = "none"
    sparse_attention: bool = False
    batch_max: int = 1


@dataclass(frozen=True)
class SpecDecision:
    enabled: bool
    reason: str  # "" when enabled


def decide_spec(mode: int, server_default: bool, temperature: float, top_p: float, min_p: float,
                caps: VerifierCaps) -> SpecDecision:
    """Decide whether a request speculates.

    Args:
        mode: SpecMode value (0 unspecified, 1 off, 2 on).
        server_default: the server's --spec flag.
        temperature, top_p, min_p: the request's sampling parameters
            (top_p already defaulted to 1 when unset).
        caps: the verifier's capabilities.
    Returns:
        SpecDecision(enabled, reason); reason names every rule that refused.
    """
    if mode == MODE_OFF:
        return SpecDecision(False, "speculation off by request (spec=SPEC_MODE_OFF)")
    if mode == MODE_UNSPECIFIED and not server_default:
        return SpecDecision(False, "speculation off: the request left spec unspecified and the"
                                   " server runs without --spec")
    reasons = []
    if temperature > 0:
        reasons.append(f"temperature {f32_str(temperature)} > 0 (speculation needs greedy decoding)")
    if top_p < 1:
        reasons.append(f"top_p {f32_str(top_p)} < 1 (speculation needs greedy decoding)")
    if min_p > 0:
        reasons.append(f"min_p {f32_str(min_p)} > 0 (speculation needs greedy decoding)")
    if caps.kv_eviction != "none":
        reasons.append(f"verifier KV eviction is {caps.kv_eviction!r} (needs 'none')")
    if caps.sparse_attention:
        reasons.append("verifier uses sparse attention (needs full attention)")
    if caps.batch_max >= 2:
        reasons.append(f"verifier batch_max {caps.batch_max} >= 2 (needs unbatched verify)")
    if reasons:
        return SpecDecision(False, "speculation refused: " + "; ".join(reasons))
    return SpecDecision(True, "")

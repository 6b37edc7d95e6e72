"""Verifier service: the target model on the C engine; prefill, verify, decode, rollback."""

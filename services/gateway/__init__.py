"""OpenAI-compatible HTTP gateway over the coordinator's gRPC API."""

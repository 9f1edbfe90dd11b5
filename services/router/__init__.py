"""The router: OpenAI-compatible HTTP gateway and gRPC Generate front over prefill/decode instances."""

"""gRPC services (prefill, decode, colocated), the router, and the planner."""

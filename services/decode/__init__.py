"""The decode service: pulls KV from prefill instances and continues with continuous batching;
without a KV connector it is the colocated service (it computes prompts itself)."""

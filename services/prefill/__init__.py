"""The prefill service: computes prompts and publishes their KV for decode instances to pull."""

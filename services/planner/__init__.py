"""The planner: an autoscaler that sizes the prefill and the decode Deployments separately."""

"""The SLA planner: prefill and decode replica counts from TTFT and ITL targets."""

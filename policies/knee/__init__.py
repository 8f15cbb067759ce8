"""Measure a backend's throughput knee and write it as that backend's `cap` in the policy file.

sweep (closed-loop load per concurrency level) -> analysis (where the curve bends) -> report (JSON, PNG,
table) and capfile (the one-line edit of the policy file). `llm-gateway knee` drives them.
"""

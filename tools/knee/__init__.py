"""Measure a backend's throughput knee.

sweep (closed-loop load per concurrency level) -> analysis (where the curve bends) -> report (JSON, PNG,
table). Writing the knee into a policy file as the backend's `cap` is a policy job (policies/capfile.py);
`llm-gateway knee` wires the two.
"""

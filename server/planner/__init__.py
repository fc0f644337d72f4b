"""SLA planner: worker counts from latency targets.

sizing.py    from a worker profile and a predicted load, the prefill and decode (or aggregated) worker counts
             that meet a TTFT and an ITL target, clamped per role and to a total budget
"""

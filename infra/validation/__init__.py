"""Launch validation: is a deployed environment serving as the design says? Connectivity and
the auth chain, a load test with a real benchmarking tool judged against the SLOs, and the
measured capacity fed back to the planner."""

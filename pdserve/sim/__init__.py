"""`pdserve sim`: a discrete-event simulation of a deployment in which every node runs pdserve's own scheduler, KV
cache manager, block pool, graph dispatcher and P/D request states, and the router's own pick policy; only the
model forward is a step-time profile (profile.py) and the KV transfer a transfer-time model (connector.py).
docs/sim.md has what is simulated and what is modelled."""

"""The randomized engine test (issue 10): a fake model and connector, an exact oracle, a seeded workload generator,
a per-step checking driver and a shrinker. tests/core/test_randomized.py runs it."""

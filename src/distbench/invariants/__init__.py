"""Correctness invariants: independent references and the checks tests assert."""

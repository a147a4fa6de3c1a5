"""Rank processes, the job protocol, and device/backend selection."""

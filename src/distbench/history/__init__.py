"""`distbench history`: the stored history as series (series.py), their change points (changepoints.py), and
what is said of each (report.py)."""

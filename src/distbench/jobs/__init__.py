"""The jobs a rank pool runs in every rank: module-level functions taking (ctx, **kwargs), a RunConfig among
them as the parent sent it, and returning plain picklable data. train.py trains, bench.py measures, fidelity.py
measures the harness against bare loops, checks.py runs what the correctness checks compare against."""

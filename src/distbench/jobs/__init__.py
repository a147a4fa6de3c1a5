"""The jobs a rank pool runs in every rank: module-level functions taking (ctx, **kwargs), a RunConfig among
them as the parent sent it, and returning plain picklable data. train.py trains, bench.py measures,
checks.py runs what the correctness checks compare against."""

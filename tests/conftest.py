import os

# Each test rank gets its share of the cores; collectives time out instead of hanging CI.
os.environ.setdefault("ZEROSHARD_PG_TIMEOUT", "120")

"""A bucket's exchange: the hook, the per-run state, statistics, rank checks, shards, take-over."""

"""Engines: what turns a schedule's planned requests into batches (batch fetch, the shard
reader, torch's worker processes), and what a failing fetch reports."""

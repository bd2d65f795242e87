"""Engines: what turns a schedule's planned requests into batches (batch fetch, the shard
reader, the worker pools of processes and threads), and what a failing fetch reports."""

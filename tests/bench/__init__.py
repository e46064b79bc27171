"""Benchmarks under bench/: smoke runs that check they work (never how fast)."""

"""The command line: replay, inject, run, demo."""
